"""Whether a request is done after its latest sampled token (vLLM's ``check_stop``).

Checked in this order, after every single appended token:

1. the token is an eos id (unless ``ignore_eos``) → FINISHED_STOPPED, no stop_reason;
2. the token is in ``stop_token_ids`` → FINISHED_STOPPED, stop_reason = the token id;
3. ``num_tokens >= max_model_len`` or ``num_output_tokens >= max_tokens`` → FINISHED_LENGTH_CAPPED
   (even below ``min_tokens``: a length cap always wins);
4. below ``min_tokens`` nothing else may stop it (the worker's sampler masks eos and stop ids
   while ``num_output_tokens < min_tokens``, as vLLM's MinTokens logits processor does).

Stop strings are not checked here: the engine client matches them on detokenized text and
aborts the request. Seam: repetition detection would be step 5.
"""

from __future__ import annotations

from shoal.engine.core.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set the request's finished status and return True when its last token ends it."""
    last_token_id = request.all_token_ids[-1]
    if last_token_id in request.stop_eos_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    if last_token_id in request.stop_token_ids:
        request.status = RequestStatus.FINISHED_STOPPED
        request.stop_reason = last_token_id
        return True
    if (
        len(request.all_token_ids) >= max_model_len
        or len(request.output_token_ids) >= request.max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
