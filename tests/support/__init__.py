"""Test tooling shared by the unit, integration and acceptance tests: waits with a deadline,
engine helpers, real `consolidation serve` processes, a TCP proxy, a browser, the invariants."""
