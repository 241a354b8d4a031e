"""Helpers shared by the test modules (plain functions and constants; the fixtures are in
conftest.py): a test module imports these, never another test module."""
