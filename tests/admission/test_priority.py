"""Priority classes: parsing a header or config value, and the tenant's class as a ceiling."""

import pytest

from admission.priority import PRIORITY_NAMES, Priority, admitted_priority


@pytest.mark.parametrize(("text", "expected"), [
    ("critical", Priority.CRITICAL),
    ("standard", Priority.STANDARD),
    ("batch", Priority.BATCH),
    ("BATCH", Priority.BATCH),
    ("Critical", Priority.CRITICAL),
    (" standard ", Priority.STANDARD),
], ids=["critical", "standard", "batch", "upper-case", "title-case", "surrounding-spaces"])
def test_a_class_is_parsed_from_its_name_in_any_case(text, expected):
    assert Priority.parse(text) is expected


@pytest.mark.parametrize("text", ["urgent", "", "0", "high", "batchy"],
                         ids=["unknown-name", "empty", "a-number", "high", "prefix-of-a-name"])
def test_a_bad_name_is_refused_naming_the_choices(text):
    with pytest.raises(ValueError, match="must be one of: critical, standard, batch") as error:
        Priority.parse(text)
    assert repr(text) in str(error.value)


def test_lower_values_are_more_urgent_and_are_what_workers_are_sent():
    assert [int(p) for p in (Priority.CRITICAL, Priority.STANDARD, Priority.BATCH)] == [0, 1, 2]
    assert PRIORITY_NAMES == ("critical", "standard", "batch")
    assert Priority.BATCH.label == "batch"


@pytest.mark.parametrize(("ceiling", "requested", "admitted"), [
    (Priority.STANDARD, None, Priority.STANDARD),
    (Priority.CRITICAL, Priority.BATCH, Priority.BATCH),
    (Priority.CRITICAL, Priority.STANDARD, Priority.STANDARD),
    (Priority.STANDARD, Priority.BATCH, Priority.BATCH),
    (Priority.STANDARD, Priority.STANDARD, Priority.STANDARD),
    (Priority.STANDARD, Priority.CRITICAL, Priority.STANDARD),
    (Priority.BATCH, Priority.CRITICAL, Priority.BATCH),
    (Priority.BATCH, Priority.STANDARD, Priority.BATCH),
], ids=["no-request-gets-the-ceiling", "critical-lowers-to-batch", "critical-lowers-to-standard",
        "standard-lowers-to-batch", "same-as-ceiling", "standard-cannot-raise-to-critical",
        "batch-cannot-raise-to-critical", "batch-cannot-raise-to-standard"])
def test_a_client_may_lower_its_class_but_never_raise_it(ceiling, requested, admitted):
    assert admitted_priority(ceiling, requested) is admitted
