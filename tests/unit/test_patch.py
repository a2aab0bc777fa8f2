"""The Patch utility: idempotent, calls the original, stacks in order (no vLLM needed)."""

import pytest

from vllm_nwor.patches._patch import Patch, PatchError, applied_ids, original


class Target:
    def greet(self, name):
        return f"hello {name}"


def _shout(greet):
    def wrapper(self, name):
        return greet(self, name).upper()

    return wrapper


def _one(greet):
    def wrapper(self, name):
        return greet(self, name) + "1"

    return wrapper


def _two(greet):
    def wrapper(self, name):
        return greet(self, name) + "2"

    return wrapper


def test_apply_is_idempotent_and_calls_the_original():
    patch = Patch(Target, "greet", _shout, why="test")
    try:
        assert patch.apply() is True
        assert Patch(Target, "greet", _shout, why="loaded again").apply() is False
        assert Target().greet("x") == "HELLO X"
        assert original(Target.greet)(Target(), "x") == "hello x"
        assert patch.is_applied()
    finally:
        patch.revert()
    assert Target().greet("x") == "hello x"


def test_patches_on_one_attribute_run_in_the_order_applied_and_revert_from_the_outside():
    first = Patch(Target, "greet", _one, why="first")
    second = Patch(Target, "greet", _two, why="second")
    try:
        assert first.apply() and second.apply()
        assert Target().greet("x") == "hello x12"  # the first applied runs first (innermost)
        assert first.is_applied() and second.is_applied()
        assert first.apply() is False  # loaded again: nothing changes
        assert applied_ids(Target.__dict__["greet"]) == [second.id, first.id]
        with pytest.raises(PatchError, match="revert"):
            first.revert()
    finally:
        second.revert()
        first.revert()
    assert Target().greet("x") == "hello x" and applied_ids(Target.__dict__["greet"]) == []


def test_new_attributes_must_not_exist_and_replacements_must():
    add = Patch(Target, "added", lambda _: (lambda self: 42), why="add", new=True)
    try:
        add.apply()
        assert Target().added() == 42
    finally:
        add.revert()
    assert not hasattr(Target, "added")
    with pytest.raises(PatchError, match="exists"):
        Patch(Target, "greet", lambda _: None, why="x", new=True).apply()
    with pytest.raises(PatchError, match="not defined"):
        Patch(Target, "missing", _shout, why="x").apply()


def test_a_module_level_function_is_patched_in_its_module():
    import types

    module = types.ModuleType("fake_runner_module")
    module.greet = lambda name: f"hello {name}"
    patch = Patch(module, "greet", lambda greet: (lambda name: greet(name).upper()), why="x")
    try:
        assert patch.apply() is True
        assert patch.attribute == "fake_runner_module.greet"
        assert module.greet("x") == "HELLO X"
    finally:
        patch.revert()
    assert module.greet("x") == "hello x"
    with pytest.raises(PatchError, match="not defined on fake_runner_module"):
        Patch(module, "missing", _shout, why="x").apply()
