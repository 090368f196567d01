"""The shared chat-template compiler (kvgate/chat_template.py): transformers' globals, its sandbox guards."""

from __future__ import annotations

import jinja2
import pytest

from kvgate.chat_template import ChatTemplateError, compile_chat_template


def test_raise_exception_is_a_template_error_and_a_value_error_with_the_message():
    template = compile_chat_template("{{ raise_exception('bad role ' + messages[0]['role']) }}")
    with pytest.raises(ChatTemplateError, match="^bad role tool$") as info:
        template.render(messages=[{"role": "tool"}])
    assert isinstance(info.value, jinja2.TemplateError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize("source", [
    "{% set ns = namespace(_secret=1) %}",
    "{% set ns = namespace(n=0) %}{% set ns._secret = 1 %}",
], ids=["constructor", "assignment"])
def test_namespace_refuses_underscore_attributes(source):
    with pytest.raises(jinja2.exceptions.SecurityError, match="underscore attribute '_secret'"):
        compile_chat_template(source).render()


def test_generation_tags_render_their_body_and_tojson_keeps_unicode():
    template = compile_chat_template("{% generation %}{{ messages | tojson }}{% endgeneration %}")
    assert template.render(messages=[{"content": "café"}]) == '[{"content": "café"}]'


def test_the_same_source_compiles_once():
    assert compile_chat_template("{{ 1 }}") is compile_chat_template("{{ 1 }}")
