"""The W3C trace context as shoal carries it (``tracing.context``): the two headers picked
from any header mapping, and whether a context asks for its request to be recorded."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.tracing.context import is_sampled, trace_headers

TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_the_w3c_headers_are_picked_in_any_case() -> None:
    given_headers = {
        "Traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01",
        "TraceState": "congo=t61rcWkgMzE",
        "Content-Type": "application/json",
    }
    assert trace_headers(given_headers) == {
        "traceparent": f"00-{TRACE_ID}-{SPAN_ID}-01",
        "tracestate": "congo=t61rcWkgMzE",
    }
    assert trace_headers({"tracestate": "a=b"}) is None  # no traceparent: no context
    assert trace_headers(None) is None and trace_headers({}) is None


@pytest.mark.parametrize(
    ("traceparent", "sampled"),
    [
        (f"00-{TRACE_ID}-{SPAN_ID}-01", True),
        (f"00-{TRACE_ID}-{SPAN_ID}-03", True),  # other flags beside sampled
        (f"00-{TRACE_ID}-{SPAN_ID}-00", False),
        (f"00-{'0' * 32}-{SPAN_ID}-01", False),  # an all-zero trace id is invalid
        (f"00-{TRACE_ID}-{'0' * 16}-01", False),
        (f"00-{TRACE_ID[:-1]}-{SPAN_ID}-01", False),
        (f"00-{TRACE_ID}-{SPAN_ID}-zz", False),
        ("garbage", False),
    ],
)
def test_sampled_means_a_well_formed_context_with_the_flag(traceparent: str, sampled: bool) -> None:
    assert is_sampled({"traceparent": traceparent}) is sampled


@given(st.text(max_size=80))
def test_no_header_value_raises(value: str) -> None:
    assert is_sampled({"traceparent": value}) in (True, False)
