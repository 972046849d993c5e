"""Tenants: API keys from a file or Secret, and per-tenant rate limits (pure, simulated clock)."""

from __future__ import annotations

import hmac
import logging
import os
from pathlib import Path

import pytest

from kvpool.router.admission import tenants as tenants_module
from kvpool.router.admission.entries import Band
from kvpool.router.admission.limits import (
    RateLimiter,
    RateLimitExceeded,
    RequestTooLarge,
    format_reset,
)
from kvpool.router.admission.tenants import (
    ANONYMOUS,
    AuthError,
    KeyStore,
    Tenant,
    TenantsError,
    parse_tenants,
)

KEY_A = "sk-team-a-0123456789abcdef"
KEY_A2 = "sk-team-a-second-key-000000"
KEY_B = "sk-team-b-fedcba9876543210"
KEY_NEW = "sk-rotated-key-5555555555555"
ALL_KEYS = (KEY_A, KEY_A2, KEY_B, KEY_NEW)

TENANTS_YAML = f"""
tenants:
  - name: team-a
    keys: ["{KEY_A}", "{KEY_A2}"]
    priority: high
    weight: 2
    requests_per_second: 20
    tokens_per_minute: 200000
    ttft_slo_s: 1.0
  - name: team-b
    keys: ["{KEY_B}"]
    admin: true
"""


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def tenant(**kw: object) -> Tenant:
    kw.setdefault("name", "t")
    kw.setdefault("keys", [KEY_A])
    return Tenant.model_validate(kw)


def assert_no_key(text: str) -> None:
    for key in ALL_KEYS:
        assert key not in text
        assert key[3:15] not in text  # not even a part of one


# -- the tenants file ------------------------------------------------------------------------


def test_a_tenants_file_declares_names_keys_classes_and_limits() -> None:
    a, b = parse_tenants(TENANTS_YAML)
    assert (a.name, a.priority, a.band, a.weight, a.admin) == (
        "team-a",
        "high",
        Band.HIGH,
        2,
        False,
    )
    assert [k.get_secret_value() for k in a.keys] == [KEY_A, KEY_A2]
    assert (a.requests_per_second, a.request_burst, a.tokens_per_minute) == (20, 20, 200000)
    assert a.ttft_slo_s == 1.0
    assert (b.band, b.weight, b.admin, b.requests_per_second, b.tokens_per_minute) == (
        Band.NORMAL,
        1.0,
        True,
        None,
        None,
    )


def test_a_json_tenants_file_is_read_too() -> None:
    text = f'{{"tenants": [{{"name": "j", "keys": ["{KEY_A}"], "requests_per_second": 0.5}}]}}'
    (j,) = parse_tenants(text)
    assert j.request_burst == 1  # max(1, rps)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            f'tenants: [{{name: a, keys: ["{KEY_A}"], prio: high}}]',
            "tenant 'a': unknown field 'prio'",
        ),
        ('tenants: [{name: a, keys: ["sk-short"]}]', "tenant 'a': keys: key #1 is shorter than 16"),
        (
            f'tenants: [{{name: a, keys: ["{KEY_A}"]}}, {{name: b, keys: ["{KEY_B}", "{KEY_A}"]}}]',
            "tenant 'b': key #2 is also a key of tenant 'a'",
        ),
        (
            f'tenants: [{{name: a, keys: ["{KEY_A}"]}}, {{name: a, keys: ["{KEY_B}"]}}]',
            "both named 'a'",
        ),
        (f'tenants: [{{name: a, keys: ["{KEY_A}", "{KEY_A}"]}}]', "key #2 repeats key #1"),
        (f'tenants: [{{name: a, keys: ["{KEY_A} x"]}}]', "key #1 has a character"),
        (f'tenants: [{{name: a, keys: ["{KEY_A}"], priority: urgent}}]', "tenant 'a': priority"),
        (f'tenants: [{{name: a, keys: ["{KEY_A}"], weight: 0}}]', "tenant 'a': weight"),
        ("tenants: [{name: a, keys: []}]", "tenant 'a': keys"),
        (f'tenants: [{{keys: ["{KEY_A}"]}}]', "tenant #1: name: Field required"),
        ("tenants: []", "tenants"),
        ("- just a list", "must be a mapping"),
        # a key pasted as a field name is not echoed back as an unknown field
        (
            f"tenants:\n  - name: a\n    keys: [{KEY_B}]\n    {KEY_A}: 1\n",
            "unknown field: not allowed",
        ),
        # PyYAML quotes the offending line in its own message; ours does not
        (f'tenants:\n  - name: a\n    keys: ["{KEY_A}"\n', "invalid YAML at line"),
        (f'{{"tenants": [{{"name": "a", "keys": ["{KEY_A}"]}}', "invalid JSON at line 1"),
    ],
)
def test_a_bad_tenants_file_is_refused_naming_the_tenant_and_field_not_the_key(
    text: str, expected: str
) -> None:
    with pytest.raises(TenantsError) as exc:
        parse_tenants(text, "tenants.yaml")
    message = str(exc.value)
    assert expected in message
    assert message.startswith("tenants.yaml: ")
    assert_no_key(message)


def test_keys_never_appear_in_repr_str_or_json() -> None:
    store = KeyStore(parse_tenants(TENANTS_YAML))
    a = store.tenants[0]
    for text in (
        repr(a),
        str(a),
        a.model_dump_json(),
        repr(store),
        str(store),
        repr(store.tenants),
    ):
        assert_no_key(text)
        assert "team-a" in text or "KeyStore" in text or "team" in text


def test_a_request_asks_for_a_band_up_to_its_tenants_class() -> None:
    normal = tenant(priority="normal")
    assert normal.band_for(None) is Band.NORMAL
    assert normal.band_for(Band.HIGH) is Band.NORMAL  # cannot jump the queue
    assert normal.band_for(Band.LOW) is Band.LOW  # may step aside
    assert tenant(priority="high").band_for(Band.HIGH) is Band.HIGH


def test_the_anonymous_tenant_is_normal_and_unlimited() -> None:
    assert ANONYMOUS.name == "anonymous" and ANONYMOUS.band is Band.NORMAL
    assert ANONYMOUS.requests_per_second is None and ANONYMOUS.tokens_per_minute is None
    limiter = RateLimiter(Clock())
    for _ in range(1000):
        assert limiter.admit(ANONYMOUS, 10**9).headers == {}


# -- keys --------------------------------------------------------------------------------------


def test_each_key_identifies_its_tenant() -> None:
    store = KeyStore(parse_tenants(TENANTS_YAML))
    assert store.lookup(KEY_A).name == "team-a"  # type: ignore[union-attr]
    assert store.lookup(KEY_A2).name == "team-a"  # type: ignore[union-attr]
    assert store.lookup(KEY_B).name == "team-b"  # type: ignore[union-attr]
    assert store.tenant("team-b").admin  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "presented",
    [KEY_A[:-1] + "X", KEY_A[:-1], KEY_A + "0", "", "ß" + KEY_A[1:], "x" * 100_000],
)
def test_a_key_that_is_not_exactly_a_tenants_key_is_refused(presented: str) -> None:
    store = KeyStore(parse_tenants(TENANTS_YAML))
    assert store.lookup(presented) is None


def test_hmac_compare_digest_decides_whether_a_key_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    store = KeyStore(parse_tenants(TENANTS_YAML))
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(tenants_module.hmac, "compare_digest", spy)
    assert store.lookup(KEY_A) is not None
    assert calls == [(KEY_A.encode(), KEY_A.encode())]
    assert store.lookup(KEY_A[:-1] + "X") is None
    assert len(calls) == 2  # a miss does the same comparison (against a dummy)
    # and its answer is final: were it to say no, the right key would not get in
    monkeypatch.setattr(tenants_module.hmac, "compare_digest", lambda a, b: False)
    assert store.lookup(KEY_A) is None


def test_a_bearer_header_names_the_tenant() -> None:
    store = KeyStore(parse_tenants(TENANTS_YAML))
    assert store.authenticate(f"Bearer {KEY_B}").name == "team-b"
    assert store.authenticate(f"bearer   {KEY_B} ").name == "team-b"


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (None, "missing"),
        ("", "missing"),
        (KEY_A, "malformed"),
        (f"Basic {KEY_A}", "malformed"),
        (f"Bearer {KEY_A} {KEY_B}", "malformed"),
        ("Bearer", "malformed"),
        (f"Bearer {KEY_A[:-1]}Z", "unknown"),
    ],
)
def test_a_missing_or_wrong_key_is_a_401_in_openais_body_without_the_key(
    header: str | None, reason: str
) -> None:
    store = KeyStore(parse_tenants(TENANTS_YAML))
    with pytest.raises(AuthError) as exc:
        store.authenticate(header)
    err = exc.value
    assert err.reason == reason
    assert err.status == 401
    body = err.body()["error"]
    assert body["type"] == "invalid_request_error"
    assert body["code"] == "invalid_api_key"
    assert err.headers["WWW-Authenticate"].startswith("Bearer")
    assert_no_key(str(body) + str(err))
    if reason == "unknown":
        assert body["message"].startswith("Incorrect API key provided")


# -- reloading -------------------------------------------------------------------------------


class SecretVolume:
    """A directory laid out as the kubelet lays out a Secret volume: ``tenants.yaml`` is a
    symlink into ``..data``, itself a symlink to a timestamped directory that an update
    replaces whole, atomically."""

    def __init__(self, root: Path, text: str) -> None:
        self.root, self.n = root, 0
        self.write(text)
        (root / "tenants.yaml").symlink_to("..data/tenants.yaml")

    @property
    def path(self) -> Path:
        return self.root / "tenants.yaml"

    def write(self, text: str) -> None:
        self.n += 1
        version = self.root / f"..2025_01_01_00_00_0{self.n}"
        version.mkdir()
        (version / "tenants.yaml").write_text(text)
        # the same mtime as before: only the content tells a change
        os.utime(version / "tenants.yaml", (1_700_000_000, 1_700_000_000))
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(version.name)
        os.replace(tmp, self.root / "..data")


def test_keys_rotated_in_the_secret_serve_after_a_reload(tmp_path: Path) -> None:
    volume = SecretVolume(tmp_path, TENANTS_YAML)
    store = KeyStore.from_file(volume.path)
    assert store.reload_if_changed().changed is False  # nothing changed yet
    volume.write(TENANTS_YAML.replace(KEY_B, KEY_NEW))
    result = store.reload_if_changed()
    assert result.changed is True and result.error is None
    assert store.lookup(KEY_NEW).name == "team-b"  # type: ignore[union-attr]
    assert store.lookup(KEY_B) is None  # the revoked key no longer works
    assert store.reload_if_changed().changed is False


def test_a_bad_new_file_keeps_the_old_keys_and_says_why_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    volume = SecretVolume(tmp_path, TENANTS_YAML)
    store = KeyStore.from_file(volume.path)
    volume.write(TENANTS_YAML.replace("priority: high", "priority: urgent").replace(KEY_B, KEY_NEW))
    with caplog.at_level(logging.WARNING, logger="kvpool.router.admission.tenants"):
        result = store.reload_if_changed()
        again = store.reload_if_changed()
    assert result.changed is False
    assert result.error is not None and "tenant 'team-a': priority" in result.error
    assert again.error == result.error
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1  # not once per poll
    assert_no_key(result.error)
    assert store.lookup(KEY_B).name == "team-b"  # type: ignore[union-attr]
    assert store.lookup(KEY_NEW) is None
    volume.write(TENANTS_YAML)  # fixed: back to the keys it serves
    assert store.reload_if_changed().error is None


def test_a_vanished_file_keeps_the_old_keys(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    store = KeyStore.from_file(path)
    path.unlink()
    result = store.reload_if_changed()
    assert result.error is not None and "cannot read" in result.error
    assert store.lookup(KEY_A) is not None


def test_a_bad_file_at_start_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(f'tenants: [{{name: a, keys: ["{KEY_A}"], rps: 3}}]')
    with pytest.raises(TenantsError, match="unknown field 'rps'") as exc:
        KeyStore.from_file(path)
    assert_no_key(str(exc.value))
    with pytest.raises(TenantsError, match="cannot read"):
        KeyStore.from_file(tmp_path / "missing.yaml")


def test_no_key_text_is_logged_loading_reloading_or_refusing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    volume = SecretVolume(tmp_path, TENANTS_YAML)
    with caplog.at_level(logging.DEBUG):
        store = KeyStore.from_file(volume.path)
        volume.write(TENANTS_YAML.replace(KEY_B, KEY_NEW))
        store.reload_if_changed()
        volume.write(TENANTS_YAML + f"  - name: c\n    keys: [{KEY_A}]\n")  # duplicate key
        store.reload_if_changed()
        for header in (f"Bearer {KEY_B}", f"Basic {KEY_A}"):
            with pytest.raises(AuthError):
                store.authenticate(header)
    assert caplog.records, "loading and reloading should be logged"
    for record in caplog.records:
        assert_no_key(record.getMessage())


# -- rate limits -------------------------------------------------------------------------------


def test_format_reset_writes_durations_as_openai_does() -> None:
    cases = {0: "0s", 0.0201: "21ms", 0.5: "500ms", 1: "1s", 1.5: "1.5s", 360: "6m0s"}
    cases |= {61.25: "1m1.25s", 3600: "1h0m0s"}
    assert {s: format_reset(s) for s in cases} == cases


def test_requests_over_the_rate_get_a_429_with_retry_after_and_ratelimit_headers() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    t = tenant(requests_per_second=2)  # burst 2
    first = limiter.admit(t, 10).headers
    assert first == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "500ms",
    }
    assert limiter.admit(t, 10).headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimitExceeded) as exc:
        limiter.admit(t, 10)
    err = exc.value
    assert err.status == 429 and err.limit == "requests"
    assert err.retry_after_s == pytest.approx(0.5)
    assert err.headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "1s",
        "Retry-After": "1",
    }
    body = err.body()["error"]
    assert body["type"] == "requests" and body["code"] == "rate_limit_exceeded"
    assert "try again in 500ms" in body["message"]
    clock.now += 0.5
    assert limiter.admit(t, 10).headers["x-ratelimit-remaining-requests"] == "0"


def test_a_burst_lets_that_many_requests_in_at_once() -> None:
    limiter = RateLimiter(Clock())
    t = tenant(requests_per_second=1, burst=5)
    for _ in range(5):
        limiter.admit(t, 1)
    with pytest.raises(RateLimitExceeded):
        limiter.admit(t, 1)


def test_tokens_over_the_minute_get_a_429_with_the_token_headers() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    t = tenant(tokens_per_minute=6000)  # 100 tokens a second
    ok = limiter.admit(t, 5000)  # a 1000-token prompt with max_tokens 4000
    assert ok.reservation.tokens == 5000
    assert ok.headers == {
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-reset-tokens": "50s",
    }
    with pytest.raises(RateLimitExceeded) as exc:
        limiter.admit(t, 2000)
    err = exc.value
    assert err.limit == "tokens" and err.status == 429
    assert err.retry_after_s == pytest.approx(10.0)
    assert err.headers["Retry-After"] == "10"
    assert err.headers["x-ratelimit-remaining-tokens"] == "1000"
    assert err.body()["error"]["type"] == "tokens"
    clock.now += 10
    assert limiter.admit(t, 2000).headers["x-ratelimit-remaining-tokens"] == "0"


def test_a_refused_request_takes_nothing_from_either_bucket() -> None:
    limiter = RateLimiter(Clock())
    t = tenant(requests_per_second=1, burst=2, tokens_per_minute=600)
    with pytest.raises(RateLimitExceeded) as exc:
        limiter.admit(t, 100)
        limiter.admit(t, 600)  # tokens refuse this one: its request is not spent
    assert exc.value.limit == "tokens"
    h = limiter.admit(t, 100).headers
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-remaining-tokens"] == "400"
    assert set(h) == {
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    }


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    limiter = RateLimiter(Clock())
    t = tenant(tokens_per_minute=600)  # 10 a second
    limiter.admit(t, 600)
    with pytest.raises(RateLimitExceeded) as exc:
        limiter.admit(t, 12)  # 1.2 s away
    assert exc.value.headers["Retry-After"] == "2"
    assert exc.value.headers["x-ratelimit-reset-tokens"] == "1m0s"


def test_a_request_larger_than_the_whole_minute_is_a_clear_400_not_an_endless_429() -> None:
    limiter = RateLimiter(Clock())
    t = tenant(tokens_per_minute=1000)
    with pytest.raises(RequestTooLarge) as exc:
        limiter.admit(t, 1001)
    err = exc.value
    assert err.status == 400
    assert err.body()["error"]["code"] == "request_too_large"
    assert "limit 1000, requested 1001" in err.message
    assert "Retry-After" not in err.headers
    assert limiter.admit(t, 1000).headers["x-ratelimit-remaining-tokens"] == "0"


def test_settling_a_request_that_used_less_gives_the_rest_back() -> None:
    limiter = RateLimiter(Clock())
    t = tenant(tokens_per_minute=6000)
    first = limiter.admit(t, 5000)
    with pytest.raises(RateLimitExceeded):
        limiter.admit(t, 4000)
    limiter.settle(first.reservation, 1000)  # it stopped early: 1000 tokens in all
    assert limiter.admit(t, 4000).headers["x-ratelimit-remaining-tokens"] == "1000"
    limiter.settle(first.reservation, 0)  # a second settlement changes nothing
    assert limiter.headers(t)["x-ratelimit-remaining-tokens"] == "1000"


def test_settling_a_request_that_used_more_delays_the_next_one() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    t = tenant(tokens_per_minute=6000)  # 100 a second
    over = limiter.admit(t, 1000)
    limiter.settle(over.reservation, 7000)  # usage beyond its reservation: 1000 in debt
    assert limiter.headers(t)["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimitExceeded) as exc:
        limiter.admit(t, 100)
    assert exc.value.retry_after_s == pytest.approx(11.0)
    clock.now += 11
    limiter.admit(t, 100)


def test_requests_can_be_counted_before_the_body_and_tokens_after_it() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    t = tenant(requests_per_second=1, tokens_per_minute=600)
    h = limiter.admit_request(t)  # before the body is read: its tokens are unknown
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-remaining-tokens"] == "600"
    with pytest.raises(RateLimitExceeded) as exc:
        limiter.admit_request(t)
    assert exc.value.limit == "requests"
    ok = limiter.reserve_tokens(t, 500)  # once tokenized; takes no request
    assert ok.reservation.tokens == 500
    assert ok.headers["x-ratelimit-remaining-tokens"] == "100"
    with pytest.raises(RateLimitExceeded) as exc:
        limiter.reserve_tokens(t, 200)
    assert exc.value.limit == "tokens"
    with pytest.raises(RequestTooLarge):
        limiter.reserve_tokens(t, 601)
    limiter.settle(ok.reservation, None)  # usage unknown: the reservation stands
    assert limiter.headers(t)["x-ratelimit-remaining-tokens"] == "100"


def test_a_tenants_new_limits_apply_after_a_reload_keeping_what_was_used() -> None:
    limiter = RateLimiter(Clock())
    before = tenant(tokens_per_minute=1000)
    limiter.admit(before, 800)
    after = tenant(tokens_per_minute=5000)
    assert limiter.headers(after)["x-ratelimit-remaining-tokens"] == "4200"
    unlimited = tenant()
    assert limiter.admit(unlimited, 10**6).headers == {}
    limiter.prune([])
    assert limiter.headers(after)["x-ratelimit-remaining-tokens"] == "5000"
