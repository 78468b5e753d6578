"""Tests of the backend-independent package: ops, API, validation, reference, plan, compile/export, stub."""
