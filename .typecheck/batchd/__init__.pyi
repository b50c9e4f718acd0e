"""The `batchd` namespace as mypy sees it: core/, proto/, service/ and client/ linked in (see
[tool.mypy] in pyproject)."""
