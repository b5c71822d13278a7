"""Fuzz ``Generate`` through the real gRPC server: every field of ``GenerateRequest``, extreme
and malformed values, random bytes where strings go (sent as raw wire bytes, which the
protobuf library would refuse to build). Each call must end within its deadline, either
with every choice finished (STOP / LENGTH) or with INVALID_ARGUMENT, RESOURCE_EXHAUSTED or
ALREADY_EXISTS whose message names a field the request set; never INTERNAL, UNKNOWN,
UNAVAILABLE or a deadline. Afterwards every block is free, the scheduler's integrity check passes and the
server still serves."""

from __future__ import annotations

import re
import string
import struct

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny_cluster import assert_all_blocks_free, running_cluster

from pagedserve.cluster.client import Client
from pagedserve.v1 import generate_pb2 as pb

pytestmark = pytest.mark.slow

MAX_EXAMPLES = 150
CALL_TIMEOUT_S = 120.0
GENERATE = "/pagedserve.v1.Generation/Generate"
ACCEPTED = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
U32 = 2**32 - 1

texts = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["", " ", "\x00", "\u200b", "\U0001f600" * 3, "a" * 600, "</s>", "<s>"]),
)
u32 = st.one_of(st.integers(0, 200), st.sampled_from([0, 1, 2, 127, 128, U32]))
i32 = st.one_of(st.integers(-3, 50), st.sampled_from([-(2**31), 2**31 - 1]))
floats = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-6, 0.5, 1.0, 2.0, 2.0000002, -2.0, 3.4e38]),
)


def opt(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.none(), strategy)


def f32(lo: float, hi: float) -> st.SearchStrategy:
    return st.floats(lo, hi).map(lambda x: struct.unpack("f", struct.pack("f", x))[0])


short = st.text(alphabet=string.ascii_letters + " .,!?", min_size=1, max_size=30)
ROLES = ["system", "user", "assistant", "tool"]
# field -> (valid values, extreme or malformed values)
FIELDS: dict[str, tuple[st.SearchStrategy, st.SearchStrategy]] = {
    "max_tokens": (st.integers(1, 12), st.sampled_from([0, 129, 1000, U32])),
    "temperature": (f32(0, 2), floats),
    "top_p": (f32(0.05, 1), floats),
    "top_k": (st.integers(-1, 50), st.sampled_from([-2, -(2**31), 2**31 - 1])),
    "seed": (st.integers(0, 2**64 - 1), st.just(2**64 - 1)),
    "n": (st.integers(1, 4), st.sampled_from([0, 16, 64, 65, U32])),
    "ignore_eos": (st.booleans(), st.booleans()),
    "logprobs": (st.integers(0, 5), st.sampled_from([20, 21, U32])),
    "repetition_penalty": (f32(0.5, 2), floats),
    "presence_penalty": (f32(-2, 2), floats),
    "frequency_penalty": (f32(-2, 2), floats),
    "min_tokens": (st.integers(0, 3), st.sampled_from([13, U32])),
    "include_stop_str_in_output": (st.booleans(), st.booleans()),
    "cache_salt": (short, st.sampled_from(["", "s" * 1025])),
    "beam_width": (st.integers(1, 3), st.sampled_from([0, 16, 17, U32])),
    "length_penalty": (f32(-2, 2), floats),
    "priority": (st.integers(-5, 5), st.sampled_from([-(2**31), 2**31 - 1])),
    "request_id": (st.just(""), st.one_of(texts, st.just("r" * 257))),
    "stop": (
        st.lists(short, max_size=2),
        st.one_of(st.lists(texts, max_size=3), st.just(["x"] * 17), st.just(["y" * 1025])),
    ),
    "stop_token_ids": (
        st.lists(st.integers(0, 127), max_size=3),
        st.one_of(st.lists(u32, max_size=4), st.just([3] * 257)),
    ),
    "input": (
        st.one_of(
            st.tuples(st.just("text"), short),
            st.tuples(st.just("token_ids"), st.lists(st.integers(0, 127), min_size=1, max_size=30)),
            st.tuples(
                st.just("chat"),
                st.lists(st.tuples(st.sampled_from(ROLES), short), min_size=1, max_size=3),
            ),
        ),
        st.one_of(
            st.none(),
            st.tuples(st.just("text"), texts),
            st.tuples(st.just("token_ids"), st.lists(u32, max_size=40)),
            st.tuples(
                st.just("chat"),
                st.lists(st.tuples(st.sampled_from([*ROLES, "", "x"]), texts), max_size=4),
            ),
        ),
    ),
}
NOT_OPTIONAL = {"request_id", "stop", "stop_token_ids", "input"}


@st.composite
def request_fields(draw: st.DrawFn) -> dict:
    """Every field: mostly valid (so requests get served), exactly one extreme field, or
    all of them anything (chaos)."""
    mode = draw(st.sampled_from(["valid", "one_bad", "chaos"]))
    bad = draw(st.sampled_from(sorted(FIELDS))) if mode == "one_bad" else None
    event(f"mode: {mode}")
    out = {}
    for name, (valid, extreme) in FIELDS.items():
        if name == bad:
            strategy = extreme
        elif mode == "chaos":
            strategy = st.one_of(valid, extreme)
        else:
            strategy = valid
        out[name] = draw(strategy if name in NOT_OPTIONAL else opt(strategy))
    return out


# Random bytes spliced in as a string field (path, wire bytes prefix); the last occurrence
# of a singular field wins, nested messages merge.
RAW_STRING_FIELDS = {
    "request_id": lambda b: _field(1, b),
    "text": lambda b: _field(2, b),
    "chat.messages.role": lambda b: _field(4, _field(1, _field(1, b))),
    "chat.messages.content": lambda b: _field(4, _field(1, _field(2, b))),
    "sampling.stop": lambda b: _field(5, _field(7, b)),
    "sampling.cache_salt": lambda b: _field(5, _field(16, b)),
}
raw_strings = st.one_of(
    st.none(), st.tuples(st.sampled_from(sorted(RAW_STRING_FIELDS)), st.binary(max_size=12))
)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def build(request_id, inp, sampling, stop, stop_token_ids, return_ids) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=request_id, return_token_ids=return_ids)
    if inp is not None:
        kind, value = inp
        if kind == "text":
            req.text = value
        elif kind == "token_ids":
            req.token_ids.ids.extend(value)
            req.token_ids.SetInParent()
        else:
            for role, content in value:
                req.chat.messages.add(role=role, content=content)
            req.chat.SetInParent()
    for name, value in sampling.items():
        if value is not None:
            setattr(req.sampling, name, value)
    req.sampling.stop.extend(stop)
    req.sampling.stop_token_ids.extend(stop_token_ids)
    return req


def set_fields(msg, prefix: str = "") -> set[str]:
    """Names (and dotted paths) of every field set in ``msg``."""
    names: set[str] = set()
    for fd, value in msg.ListFields():
        names |= {fd.name, prefix + fd.name}
        if fd.message_type is not None:
            items = value if fd.is_repeated else [value]
            for item in items:
                names |= set_fields(item, prefix + fd.name + ".")
    return names


def names_a_field(details: str, fields: set[str]) -> bool:
    return any(re.search(rf"(?<![\w.]){re.escape(f)}(?![\w])", details) for f in fields)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with (
        running_cluster(tiny_llama_dir, num_blocks=48, max_model_len=128) as (handle, _),
        Client(handle.address, timeout_s=60) as client,
        grpc.insecure_channel(handle.address) as channel,
    ):
        client.wait_ready()
        yield client, channel.unary_stream(GENERATE)
        assert_all_blocks_free(handle, client, timeout_s=60)
        r = client.generate(token_ids=[5, 6, 7], max_tokens=4, temperature=0, ignore_eos=True)
        assert len(r.choices[0].token_ids) == 4  # still serving
        assert_all_blocks_free(handle, client, timeout_s=60)


@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(f=request_fields(), return_ids=st.booleans(), raw=raw_strings)
def test_generate_never_crashes_hangs_or_leaks(server, f, return_ids, raw):
    _, call = server
    sampling = {k: v for k, v in f.items() if k not in NOT_OPTIONAL}
    req = build(f["request_id"], f["input"], sampling, f["stop"], f["stop_token_ids"], return_ids)
    fields = set_fields(req) | ({"prompt"} if f["input"] is not None else {"input"})
    data = req.SerializeToString()
    if raw is not None:
        path, payload = raw
        data += RAW_STRING_FIELDS[path](payload)
        fields |= {path, *path.split(".")}
    finished: dict[int, int] = {}
    try:
        for item in call(data, timeout=CALL_TIMEOUT_S):
            msg = pb.GenerateResponse.FromString(item)
            assert msg.index not in finished, "a choice continued after its last item"
            if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                finished[msg.index] = msg.finish_reason
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        event(f"refused: {code.name}")
        assert code in ACCEPTED, f"{code}: {details}"
        assert names_a_field(details, fields), f"{details!r} names none of {sorted(fields)}"
        return
    beam_width = sampling["beam_width"] or 1
    n = sampling["n"] if sampling["n"] is not None else (beam_width if beam_width > 1 else 1)
    assert sorted(finished) == list(range(n)), "not every choice ended"
    event("served: every choice finished")
    assert set(finished.values()) <= {pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH}
