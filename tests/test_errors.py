"""One error home: every public graphguard error lives in graphguard.errors."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import graphguard
from graphguard import distributed, errors
from graphguard.verify import VerifyReport


def _library_modules() -> list[str]:
    return [info.name for info in pkgutil.walk_packages(graphguard.__path__, "graphguard.")]


def test_no_library_module_defines_its_own_exception() -> None:
    strays = []
    for name in _library_modules():
        mod = importlib.import_module(name)
        for attr, obj in vars(mod).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == name
                and name != "graphguard.errors"
            ):
                strays.append(f"{name}.{attr}")
    assert strays == []


def test_every_public_error_is_a_graphguard_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.GraphGuardError), name


@pytest.mark.parametrize(
    "name",
    [
        "DistributedError",
        "BatchMismatchError",
        "CapturePlanMismatchError",
        "DistributedCaptureError",
    ],
)
def test_distributed_errors_live_in_errors_and_stay_importable_from_distributed(name: str) -> None:
    assert getattr(distributed, name) is getattr(errors, name)
    assert name in errors.__all__ and name in distributed.__all__


def test_divergence_error_declares_its_report() -> None:
    report = VerifyReport(runner="GraphRunner(f)")
    err = errors.DivergenceError("diverged", report=report)
    assert err.report is report
    assert errors.DivergenceError("no report").report is None


def test_config_error_is_a_value_error_for_callers_catching_builtins() -> None:
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.ConfigError, errors.GraphGuardError)
