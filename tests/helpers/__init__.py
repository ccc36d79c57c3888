"""Helpers of the test suite: seeded cases, collective assertions, the tolerance model, reference
checks and the scripts the process tests launch (`python -m helpers.<name>` from tests/).
Test modules import from here, never from one another."""
