"""The `batchd` namespace as mypy sees it: core/ and proto/ linked in (see [tool.mypy] in pyproject)."""
