"""What S3-compatible stores other than AWS S3 need from the S3 client: checksum settings,
and Google Cloud Storage's own write preconditions (its generation numbers).

Owns: telling an AWS endpoint from another one (`is_aws_endpoint`), the checksum settings
for the others (`checksum_settings`), the version token of a conditional write
(`version_token`: the ETag, or on GCS the object's generation) and the keyword arguments
that make a PutObject / DeleteObject conditional on it (`conditions`), with the botocore
hooks that turn them into GCS's `x-goog-if-generation-match` header (`add_gcs_preconditions`).
Does not own the client itself, its retries or its errors, and imports no boto3
(esd_worker.core.store.s3, the one module that does, hands it the client).
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

# boto3 >= 1.36 adds integrity checksums to every request that can carry one: PutObject and
# UploadPart get x-amz-checksum-crc32 / x-amz-sdk-checksum-algorithm, or over HTTPS a body
# sent as `Content-Encoding: aws-chunked` with a trailing checksum, and GetObject asks for
# x-amz-checksum-mode. GCS's XML API and other S3-compatibles refuse these (boto/boto3#4400,
# #4409; PostHog/posthog#40593 for GCS); "when_required" is botocore's own remedy and sends a
# checksum only where the operation demands one (DeleteObjects, which the store does not use).
WHEN_REQUIRED = "when_required"
_CHECKSUM_SETTINGS = (
    ("request_checksum_calculation", "AWS_REQUEST_CHECKSUM_CALCULATION"),
    ("response_checksum_validation", "AWS_RESPONSE_CHECKSUM_VALIDATION"),
)
_AWS_HOST_SUFFIXES = (".amazonaws.com", ".amazonaws.com.cn", ".api.aws")

# GCS's XML API preconditions on writes are its own headers, compared with the object's
# generation (a number GCS gives each version of an object and returns as x-goog-generation);
# 0 means "no live object". https://cloud.google.com/storage/docs/request-preconditions and
# https://cloud.google.com/storage/docs/xml-api/reference-headers#xgoogifgenerationmatch
# Those pages do not say that GCS holds an upload or a delete to S3's If-None-Match '*' /
# If-Match (the S3 conditional-write semantics): the store sends GCS's header beside them
# (both say the same thing, and an S3 store ignores an x-goog header it does not know).
GENERATION_HEADER = "x-goog-generation"
IF_GENERATION_MATCH = "x-goog-if-generation-match"
_GENERATION_PARAM = "EsdIfGenerationMatch"  # ours: taken out before botocore validates
_CONTEXT_KEY = "esd_if_generation_match"
_GENERATION_TOKEN = "generation:"
_CONDITIONAL_OPERATIONS = ("PutObject", "DeleteObject")


def is_aws_endpoint(endpoint_url: str | None) -> bool:
    """Whether the client talks to AWS S3 itself (no endpoint set, or an AWS host)."""
    if not endpoint_url:
        return True
    host = (urlsplit(endpoint_url).hostname or "").lower()
    return host.endswith(_AWS_HOST_SUFFIXES)


def checksum_settings(scoped_config: dict[str, Any]) -> dict[str, str]:
    """botocore Config arguments: `when_required` for each checksum setting the user left
    unset (environment or the profile's config file); a setting the user chose is kept."""
    return {name: WHEN_REQUIRED for name, env in _CHECKSUM_SETTINGS
            if not os.environ.get(env) and not scoped_config.get(name)}


def version_token(response: dict[str, Any]) -> str:
    """What a later conditional write compares with: on GCS (the reply names a generation)
    that generation, else the ETag."""
    headers = response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
    generation = headers.get(GENERATION_HEADER)
    if generation:
        return f"{_GENERATION_TOKEN}{generation}"
    return str(response["ETag"])


def conditions(token: str | None, *, gcs_headers: bool) -> dict[str, str]:
    """PutObject / DeleteObject keyword arguments making the request conditional.

    token None: only if the key is absent (If-None-Match '*', and GCS's generation 0 when
    gcs_headers); a generation token: GCS's x-goog-if-generation-match alone (GCS gave no
    ETag to compare); an ETag: If-Match.
    """
    if token is None:
        absent = {"IfNoneMatch": "*"}
        return absent | {_GENERATION_PARAM: "0"} if gcs_headers else absent
    if token.startswith(_GENERATION_TOKEN):
        return {_GENERATION_PARAM: token[len(_GENERATION_TOKEN):]}
    return {"IfMatch": token}


def add_gcs_preconditions(client: Any) -> None:
    """Let PutObject / DeleteObject take EsdIfGenerationMatch, sent as GCS's precondition
    header: moved into the request's context before botocore validates the parameters, and
    into the headers before the request is signed (SigV4 signs it with the others)."""
    events = client.meta.events
    for operation in _CONDITIONAL_OPERATIONS:
        # unique_id: registering on the same client twice adds nothing.
        events.register(f"provide-client-params.s3.{operation}", _take_generation,
                        unique_id=f"esd-take-generation-{operation}")
        events.register(f"before-call.s3.{operation}", _send_generation,
                        unique_id=f"esd-send-generation-{operation}")


def _take_generation(params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    generation = params.pop(_GENERATION_PARAM, None)
    if generation is not None:
        context[_CONTEXT_KEY] = str(generation)


def _send_generation(params: dict[str, Any], **_: Any) -> None:
    generation = params.get("context", {}).get(_CONTEXT_KEY)
    if generation is not None:
        params["headers"][IF_GENERATION_MATCH] = generation
