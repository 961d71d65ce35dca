"""The hypothesis settings of the property-based tests whose examples are whole sessions (real
tokenizers, renders, stores): the same examples every run, no example database, no deadline (a
loaded machine), and the health checks that such examples trip by their size left out."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def session_settings(max_examples: int, *extra: HealthCheck) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.function_scoped_fixture,
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            *extra,
        ],
    )
