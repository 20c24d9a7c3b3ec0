"""Wire schemas, key names, the rq serializer and batched Redis writes shared by producers and
workers. Imports no MLX."""

from schemas import keys
from schemas.request import (
    ChatMessage,
    GenerationRequest,
    ImagePart,
    InvalidRequestError,
    RequestLimits,
    TextPart,
)
from schemas.result import Choice, ErrorInfo, GenerationResult, Speculation, Timings, TopLogprob, Usage

__all__ = [
    "ChatMessage",
    "Choice",
    "ErrorInfo",
    "GenerationRequest",
    "GenerationResult",
    "ImagePart",
    "InvalidRequestError",
    "RequestLimits",
    "Speculation",
    "TextPart",
    "Timings",
    "TopLogprob",
    "Usage",
    "keys",
]
