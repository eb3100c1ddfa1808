"""S3 GETs through obstore (a Rust client): the reader's shard objects, manifests, receipts.

s3fs fetched the reader's objects at 0.55 of obstore's rate with ~3x its CPU (issue 12), so
:class:`featstore.storage.Storage` sends its reads here; writes, listings, deletes and
conditional creates stay on s3fs. :func:`plan` translates the ``storage_options`` featstore
accepts into obstore's config and returns None for anything it cannot translate faithfully
(a custom session, requester pays, SSE-C, an endpoint from a config file, ...): those stores keep
reading through s3fs. ``FEATSTORE_S3_CLIENT=s3fs`` forces that for every store.

Credentials, region and the retry budget are resolved by botocore, exactly as s3fs resolves
them (environment, profile, config file, role), so both clients behave the same; secrets never
reach a message (:meth:`S3Getter._error` scrubs them). A client is built per process by the
caller: the tokio runtime and connections of a parent must not be used in a forked child.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from .errors import StorePermissionDenied, StoreUnavailable

#: ``FEATSTORE_S3_CLIENT``: "obstore" (default where it translates) or "s3fs" (always s3fs).
CLIENT_ENV = "FEATSTORE_S3_CLIENT"
#: Options that change nothing a GET does (s3fs's caches, upload sizes, featstore's own).
_NEUTRAL = frozenset({"max_concurrency", "use_listings_cache", "listings_expiry_time", "max_paths",
                      "skip_instance_cache", "default_block_size", "default_fill_cache",
                      "default_cache_type", "fixed_upload_size", "cache_regions"})
_FALSE_ONLY = frozenset({"requester_pays", "version_aware", "asynchronous"})
_CONFIG_KEYS = frozenset({"retries", "read_timeout", "connect_timeout", "max_pool_connections",
                          "region_name", "signature_version", "s3"})
#: Environment and profile settings botocore applies that this translation does not: a store
#: with one of them set keeps reading through s3fs.
_UNTRANSLATED_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_USE_FIPS_ENDPOINT",
                     "AWS_USE_DUALSTACK_ENDPOINT", "AWS_S3_US_EAST_1_REGIONAL_ENDPOINT")
_UNTRANSLATED_PROFILE = frozenset({"endpoint_url", "services", "s3", "ca_bundle", "use_fips_endpoint",
                                   "use_dualstack_endpoint"})
#: botocore's connect and read timeouts (seconds) when the user sets none.
BOTOCORE_TIMEOUT = 60
#: Backoff between attempts: about botocore's (random up to 1, 2, 4, 8 s, at most 20 s).
BACKOFF = {"init_backoff": timedelta(seconds=0.5), "max_backoff": timedelta(seconds=20), "base": 2}


@dataclass(frozen=True)
class Plan:
    """What a process needs to build its client; secrets hidden from the repr."""

    bucket: str
    config: dict[str, Any] = field(repr=False)
    client_options: dict[str, Any]
    attempts: int
    session: Any = field(repr=False, default=None)  # botocore session: credentials from its chain
    secrets: tuple[str, ...] = field(repr=False, default=())


def plan(url: str, options: Mapping[str, Any], fs: Any = None) -> Plan | None:
    """obstore's configuration for reads of ``url`` with s3fs's ``options``, or None where a
    faithful translation is not possible (or ``FEATSTORE_S3_CLIENT=s3fs``)."""
    choice = os.environ.get(CLIENT_ENV, "obstore").strip().lower() or "obstore"
    if choice not in ("obstore", "s3fs"):
        raise StoreUnavailable(f"{CLIENT_ENV}={choice!r}: use 'obstore' (the default) or 's3fs'.")
    if choice == "s3fs":
        return None
    try:
        import botocore.session
        import obstore  # noqa: F401 - only its presence is checked here
    except ImportError:
        return None
    opts = dict(options)
    client = dict(opts.pop("client_kwargs", None) or {})
    conf = dict(opts.pop("config_kwargs", None) or {})
    profile = opts.pop("profile", None)
    key = opts.pop("key", None) or opts.pop("username", None)  # s3fs's aliases
    secret = opts.pop("secret", None) or opts.pop("password", None)
    token, anon = opts.pop("token", None), bool(opts.pop("anon", False))
    endpoint = opts.pop("endpoint_url", None) or client.pop("endpoint_url", None)
    region = client.pop("region_name", None) or conf.pop("region_name", None)
    use_ssl = opts.pop("use_ssl", True)
    if any(opts.pop(k, False) for k in _FALSE_ONLY) or opts.pop("s3_additional_kwargs", None):
        return None
    for k in _NEUTRAL:
        opts.pop(k, None)
    addressing = (conf.pop("s3", None) or {}).copy()
    style = addressing.pop("addressing_style", "auto")
    if opts or client or set(conf) - _CONFIG_KEYS or addressing or style not in ("auto", "path", "virtual") \
            or conf.get("signature_version", "s3v4") != "s3v4" or bool(key) != bool(secret):
        return None  # a custom session, a CA bundle, proxies, another signer, ...: not translated
    session = botocore.session.Session(profile=profile)
    if _UNTRANSLATED_PROFILE & set(session.get_scoped_config()):
        return None
    if any(os.environ.get(k) for k in _UNTRANSLATED_ENV):
        return None
    attempts = _attempts(conf.get("retries"), session)
    if attempts is None:
        return None
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    if endpoint is None:  # AWS: botocore follows a bucket's region; obstore must be told it
        region = _bucket_region(fs, bucket)
        if region is None:
            return None
        endpoint = f"https://s3.{region}.amazonaws.com"
        if style != "path" and "." not in bucket:
            endpoint = f"https://{bucket}.s3.{region}.amazonaws.com"
    elif not use_ssl and endpoint.startswith("https://"):
        endpoint = "http://" + endpoint[len("https://"):]
    if endpoint.startswith("https://") and os.environ.get("AWS_CA_BUNDLE"):
        return None  # botocore's CA bundle replaces the system roots; obstore's would only add
    cfg: dict[str, Any] = {"endpoint": endpoint, "region": region or session.get_config_variable("region")
                           or "us-east-1", "virtual_hosted_style_request": endpoint.startswith(f"https://{bucket}."),
                           "skip_signature": anon, "request_payer": False}
    if key and not anon:
        cfg.update(access_key_id=key, secret_access_key=secret, **({"token": token} if token else {}))
    read = conf.get("read_timeout", BOTOCORE_TIMEOUT)
    connect = conf.get("connect_timeout", BOTOCORE_TIMEOUT)
    client_options = {"allow_http": endpoint.startswith("http://"), "connect_timeout": timedelta(seconds=connect),
                      "read_timeout": timedelta(seconds=read),
                      # botocore bounds no whole request: a big object on a slow link must not time out
                      "timeout": timedelta(hours=24)}
    return Plan(bucket, cfg, client_options, attempts, None if key or anon else session,
                tuple(s for s in (key, secret, token) if s))


def _attempts(retries: Mapping[str, Any] | None, session: Any) -> int | None:
    """Total attempts per request as botocore counts them (client config, then AWS_MAX_ATTEMPTS
    or the profile, then the mode's default); None for the adaptive mode (client-side rate
    limiting: not translated)."""
    retries = dict(retries or {})
    mode = retries.get("mode") or session.get_config_variable("retry_mode") or "legacy"
    if mode not in ("standard", "legacy"):
        return None
    if "total_max_attempts" in retries:
        return max(1, int(retries["total_max_attempts"]))
    if "max_attempts" in retries:  # botocore's client config: retries, not attempts
        return max(1, int(retries["max_attempts"]) + 1)
    configured = session.get_config_variable("max_attempts")
    return max(1, int(configured)) if configured is not None else (3 if mode == "standard" else 5)


def _bucket_region(fs: Any, bucket: str) -> str | None:
    """The bucket's region, asked through s3fs (botocore follows the redirect and the header
    names the region even when the answer is 403); None when it cannot be told."""
    if fs is None:
        return None
    from fsspec.asyn import sync

    try:
        meta = sync(fs.loop, fs._call_s3, "head_bucket", Bucket=bucket)["ResponseMetadata"]
    except Exception as exc:  # noqa: BLE001 - ClientError with a response, or no region at all
        meta = (getattr(exc, "response", None) or {}).get("ResponseMetadata", {})
    return (meta.get("HTTPHeaders") or {}).get("x-amz-bucket-region")


def _credentials(session: Any) -> Callable[[], dict[str, Any]]:
    """obstore's credential callback over botocore's chain (the same chain s3fs uses)."""

    def provide() -> dict[str, Any]:
        creds = session.get_credentials()
        if creds is None:
            raise StoreUnavailable("no S3 credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                                   "AWS_PROFILE or a role (see the README section 'Credentials').")
        frozen = creds.get_frozen_credentials()
        expiry: datetime | None = getattr(creds, "_expiry_time", None)  # refreshable ones expire
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key,
                "token": frozen.token, "expires_at": expiry - timedelta(minutes=5) if expiry else None}

    return provide


class S3Getter:
    """One process's obstore client for one bucket: whole and ranged GETs, bytes only."""

    def __init__(self, plan: Plan, url: str) -> None:
        from obstore.store import S3Store

        self.pid, self._url, self._secrets = os.getpid(), url, plan.secrets
        retry = {"max_retries": plan.attempts - 1, "backoff": BACKOFF,
                 # attempts decide, as in botocore: the time bound never cuts the budget short
                 "retry_timeout": timedelta(hours=24)}
        extra = {"credential_provider": _credentials(plan.session)} if plan.session is not None else {}
        self._store = S3Store(plan.bucket, config=plan.config, client_options=plan.client_options,
                              retry_config=retry, **extra)  # type: ignore[arg-type]

    def get(self, path: str, start: int | None = None, stop: int | None = None) -> bytes | None:
        """Bytes of ``bucket/key`` ``path`` (``[start, stop)``; a negative ``start`` alone: the
        last ``-start`` bytes); None when the object does not exist."""
        import obstore

        key = path.split("/", 1)[1]
        try:
            if start is None and stop is None:
                return bytes(obstore.get(self._store, key).bytes())
            if start is not None and start < 0 and stop is None:
                return bytes(obstore.get(self._store, key, options={"range": {"suffix": -start}}).bytes())
            begin = start or 0
            if stop is not None and stop <= begin:  # an empty range: S3 has no such request
                obstore.head(self._store, key)
                return b""
            rng: Any = {"offset": begin} if stop is None else (begin, stop)
            return bytes(obstore.get(self._store, key, options={"range": rng}).bytes())
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - obstore raises its own tree and builtins
            raise self._error(exc, path) from None  # the cause may echo the request: not chained

    def _error(self, exc: Exception, path: str) -> StoreUnavailable:
        """The typed error, its message scrubbed of every secret this client was given."""
        from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

        detail = str(exc)
        for s in self._secrets + tuple(filter(None, (os.environ.get("AWS_SECRET_ACCESS_KEY"),
                                                      os.environ.get("AWS_SESSION_TOKEN")))):
            detail = detail.replace(s, "***")
        name = type(exc).__name__
        if isinstance(exc, (PermissionDeniedError, UnauthenticatedError, PermissionError)):
            return StorePermissionDenied(f"permission denied at {path} ({name}: {detail}). Check the "
                                         "credentials (environment, profile or role) and the bucket policy.")
        return StoreUnavailable(f"cannot reach the store at {self._url} reading {path} ({name}: {detail}). "
                                "Check the URL, the endpoint and that credentials are available "
                                "(AWS_ACCESS_KEY_ID/AWS_PROFILE or a role); see the README section "
                                "'Credentials'. FEATSTORE_S3_CLIENT=s3fs reads through s3fs instead.")
