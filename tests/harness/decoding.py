"""A JSON request's fields decoded under a deployment's policy, as the handler decodes them."""

from __future__ import annotations

import pytest

from handler.api.errors import FieldError, RequestError
from handler.api.policy import RequestPolicy
from handler.api.protocol import IncomingRequest, decode
from handler.api.request import GenerationRequest


def decoded(policy: RequestPolicy, **fields) -> GenerationRequest:
    """The request of ``{"prompt": "p", **fields}``."""
    return decode(IncomingRequest({"prompt": "p", **fields}, "application/json"), policy)


def refusal(policy: RequestPolicy, **fields) -> FieldError:
    """The one error refusing ``{"prompt": "p", **fields}``."""
    with pytest.raises(RequestError) as raised:
        decoded(policy, **fields)
    (error,) = raised.value.errors
    return error
