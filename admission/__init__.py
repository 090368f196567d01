"""Admission control: tenants, limits, queues and retry budgets (pure logic, time injected)."""
