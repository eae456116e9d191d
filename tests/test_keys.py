"""Tests for rendezvous.keys: parsing, formatting and validation of rendezvous keys."""

from __future__ import annotations

import pickle

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rendezvous.errors import InvalidArgument, InvalidKey
from rendezvous.keys import (
    DeviceName,
    Key,
    TaskName,
    as_key,
    format_key,
    make_key,
    parse_key,
)

REAL = ("/job:ps/replica:0/task:0/cpu:0;ccc0db7aa974ba53;/job:worker/replica:0/task:0/gpu:0;"
        "edge_37_report_uninitialized_variables/boolean_mask/Where;0:0")
CPU = "/job:worker/replica:0/task:0/device:CPU:0"
GPU = "/job:worker/replica:0/task:1/device:GPU:0"
INC = "0000000000001234"


def key_str(src: str = CPU, inc: str = INC, dst: str = GPU, name: str = "edge", fi: str = "0:0") -> str:
    return f"{src};{inc};{dst};{name};{fi}"


# -- the real example -----------------------------------------------------


def test_real_example_parses() -> None:
    k = parse_key(REAL)
    assert k.src_device == "/job:ps/replica:0/task:0/cpu:0"
    assert k.src_incarnation == 0xCCC0DB7AA974BA53
    assert k.dst_device == "/job:worker/replica:0/task:0/gpu:0"
    assert k.name == "edge_37_report_uninitialized_variables/boolean_mask/Where"
    assert (k.frame_id, k.iter_id) == (0, 0)
    assert k.src_task == TaskName("ps", 0, 0)
    assert k.dst_task == TaskName("worker", 0, 0)
    assert k.src == DeviceName("ps", 0, 0, "cpu", 0, True)
    assert k.dst == DeviceName("worker", 0, 0, "gpu", 0, True)
    assert k.dst.is_gpu and not k.src.is_gpu
    assert k.format() == REAL == str(k) == format_key(k)
    assert Key.parse(REAL) == k


# -- valid keys -----------------------------------------------------------

VALID_KEYS = [
    REAL,
    key_str(),
    key_str(inc="ffffffffffffffff"),
    key_str(inc="0000000000000000"),
    key_str(src="/cpu:0", dst="/gpu:0"),
    key_str(src="/CPU:0", dst="/device:GPU:3"),
    key_str(src="/job:worker/task:1/device:CPU:0"),
    key_str(src="/job:worker/replica:2/device:CPU:0"),
    key_str(src="/job:worker/device:CPU:0"),
    key_str(src="/replica:0/task:0/device:CPU:0"),
    key_str(src="/task:3/cpu:0"),
    key_str(src="/job:a_1/replica:0/task:0/device:XLA_GPU:7"),
    key_str(src="/job:w/replica:0/task:0/device:TPU_SYSTEM:0"),
    key_str(src="/job:localhost/replica:0/task:0/device:job:0"),  # 'job' is a fine type after device:
    key_str(src="/job:w/replica:2147483647/task:2147483647/device:CPU:2147483647"),
    key_str(name="a name with spaces: and / slashes"),
    key_str(name=":"),
    key_str(name="ü✓ unicode"),
    key_str(name="x\ny\tz"),
    key_str(fi="18446744073709551615:9223372036854775807"),
    key_str(fi="7:42"),
]


@pytest.mark.parametrize("s", VALID_KEYS)
def test_valid_keys_round_trip(s: str) -> None:
    k = Key.parse(s)
    assert k.format() == s
    assert Key.parse(k.format()) == k
    assert parse_key(s) == k
    assert str(k.src) == k.src_device and str(k.dst) == k.dst_device


@pytest.mark.parametrize(("inc", "value"), [
    ("1", 1),
    ("0", 0),
    ("ABCDEF", 0xABCDEF),
    ("CCC0DB7AA974BA53", 0xCCC0DB7AA974BA53),
    ("FfFfFfFfFfFfFfFf", 2**64 - 1),
])
def test_incarnation_parses_case_insensitively_and_formats_lowercase(inc: str, value: int) -> None:
    k = parse_key(key_str(inc=inc))
    assert k.src_incarnation == value
    assert k.format().split(";")[1] == f"{value:016x}"
    assert len(k.format().split(";")[1]) == 16


# -- invalid keys ---------------------------------------------------------

INVALID_KEYS = [
    # the overall shape
    ("", "key"),
    ("no separators", "key"),
    (";;;", "key"),
    (key_str() + ";", "key"),
    (key_str(name="a;b"), "key"),
    (f"{CPU};{INC};{GPU};edge", "key"),
    (f"{CPU};{INC};{GPU};edge;0:0;extra", "key"),
    # src_device
    (key_str(src=""), "src_device"),
    (key_str(src="cpu:0"), "src_device"),
    (key_str(src="/"), "src_device"),
    (key_str(src="/job:worker/replica:0/task:0"), "src_device"),  # no device part
    (key_str(src="/job:worker/task:1"), "src_device"),
    (key_str(src="/job:worker"), "src_device"),
    (key_str(src="/job:1worker/cpu:0"), "src_device"),
    (key_str(src="/job:_w/cpu:0"), "src_device"),
    (key_str(src="/job:wor-ker/cpu:0"), "src_device"),
    (key_str(src="/job:/cpu:0"), "src_device"),
    (key_str(src="/job:w/replica:-1/cpu:0"), "src_device"),
    (key_str(src="/job:w/replica:+1/cpu:0"), "src_device"),
    (key_str(src="/job:w/replica: 1/cpu:0"), "src_device"),
    (key_str(src="/job:w/replica:01/cpu:0"), "src_device"),
    (key_str(src="/job:w/replica:x/cpu:0"), "src_device"),
    (key_str(src="/job:w/task:/cpu:0"), "src_device"),
    (key_str(src="/job:w/task:2147483648/cpu:0"), "src_device"),
    (key_str(src="/job:w/task:\u0661/cpu:0"), "src_device"),  # ARABIC-INDIC DIGIT ONE
    (key_str(src="/task:0/job:w/cpu:0"), "src_device"),  # out of order
    (key_str(src="/job:w/task:0/replica:0/cpu:0"), "src_device"),
    (key_str(src="/job:w/job:v/cpu:0"), "src_device"),  # repeated
    (key_str(src="/job:w/task:0/task:0/cpu:0"), "src_device"),
    (key_str(src="/cpu:0/job:w"), "src_device"),  # device not last
    (key_str(src="/cpu:0/gpu:0"), "src_device"),
    (key_str(src="/job:w/cpu:0/"), "src_device"),
    (key_str(src="//cpu:0"), "src_device"),
    (key_str(src="/cpu:"), "src_device"),
    (key_str(src="/cpu:-1"), "src_device"),
    (key_str(src="/cpu:*"), "src_device"),
    (key_str(src="/cpu"), "src_device"),
    (key_str(src="/1cpu:0"), "src_device"),
    (key_str(src="/device:CPU"), "src_device"),
    (key_str(src="/device:CPU:0:1"), "src_device"),
    (key_str(src="/device:1PU:0"), "src_device"),
    (key_str(src="/device::0"), "src_device"),
    (key_str(src="/Task:1"), "src_device"),  # a component word is not a legacy type
    (key_str(src="/job:w/replica:0/task:0/device:CPU:0 "), "src_device"),
    (key_str(src=" /cpu:0"), "src_device"),
    # src_incarnation
    (key_str(inc=""), "src_incarnation"),
    (key_str(inc="xyz"), "src_incarnation"),
    (key_str(inc="0x1234"), "src_incarnation"),
    (key_str(inc="-1"), "src_incarnation"),
    (key_str(inc="+1"), "src_incarnation"),
    (key_str(inc=" 1"), "src_incarnation"),
    (key_str(inc="1 "), "src_incarnation"),
    (key_str(inc="1_0"), "src_incarnation"),
    (key_str(inc="1" * 17), "src_incarnation"),
    (key_str(inc="0" * 17), "src_incarnation"),
    (key_str(inc="g"), "src_incarnation"),
    # dst_device
    (key_str(dst=""), "dst_device"),
    (key_str(dst="/job:worker/replica:0/task:0"), "dst_device"),
    (key_str(dst="/gpu"), "dst_device"),
    (key_str(dst="gpu:0"), "dst_device"),
    # name
    (key_str(name=""), "name"),
    # frame_iter
    (key_str(fi=""), "frame_iter"),
    (key_str(fi="0"), "frame_iter"),
    (key_str(fi=":"), "frame_iter"),
    (key_str(fi="0:"), "frame_iter"),
    (key_str(fi=":0"), "frame_iter"),
    (key_str(fi="0:0:0"), "frame_iter"),
    (key_str(fi="-1:0"), "frame_iter"),
    (key_str(fi="0:-1"), "frame_iter"),
    (key_str(fi="+1:0"), "frame_iter"),
    (key_str(fi="01:0"), "frame_iter"),
    (key_str(fi="0:00"), "frame_iter"),
    (key_str(fi=" 0:0"), "frame_iter"),
    (key_str(fi="0:0 "), "frame_iter"),
    (key_str(fi="a:0"), "frame_iter"),
    (key_str(fi="18446744073709551616:0"), "frame_iter"),
    (key_str(fi="0:9223372036854775808"), "frame_iter"),
    (key_str(fi="1" * 5000 + ":0"), "frame_iter"),  # no int() digit-limit ValueError
]


@pytest.mark.parametrize(("s", "field"), INVALID_KEYS)
def test_invalid_keys(s: str, field: str) -> None:
    with pytest.raises(InvalidKey) as info:
        Key.parse(s)
    assert info.value.field == field
    assert info.value.message.startswith("invalid rendezvous key:")
    if field != "key":
        assert field.split("_")[0] in info.value.message  # names the field
    with pytest.raises(InvalidKey) as cached:
        parse_key(s)
    assert cached.value.field == field


def test_first_bad_field_is_reported() -> None:
    with pytest.raises(InvalidKey) as info:
        Key.parse(key_str(src="bad", inc="xyz", dst="bad", name="", fi="bad"))
    assert info.value.field == "src_device"
    with pytest.raises(InvalidKey) as info:
        Key.parse(key_str(inc="xyz", dst="bad", name="", fi="bad"))
    assert info.value.field == "src_incarnation"


def test_message_quotes_the_bad_text_and_the_key() -> None:
    s = key_str(inc="xyz")
    with pytest.raises(InvalidKey) as info:
        Key.parse(s)
    assert info.value.message == f"invalid rendezvous key: src_incarnation 'xyz' is not hexadecimal (in {s!r})"
    with pytest.raises(InvalidKey, match="17 hex digits"):
        Key.parse(key_str(inc="1" * 17))
    with pytest.raises(InvalidKey, match=r"'/job:worker/task:1'.*no device part"):
        Key.parse(key_str(dst="/job:worker/task:1"))


def test_long_key_message_is_shortened() -> None:
    s = key_str(name="n" * 100_000, fi="x")
    with pytest.raises(InvalidKey) as info:
        Key.parse(s)
    assert len(info.value.message) < 1000
    assert str(len(s)) in info.value.message


@pytest.mark.parametrize("bad", [None, b"/cpu:0;1;/cpu:0;n;0:0", 1, ["x"], {"a": 1}])
def test_non_string_key(bad: object) -> None:
    for parse in (Key.parse, parse_key, as_key):
        with pytest.raises(InvalidKey) as info:
            parse(bad)  # type: ignore[arg-type]
        assert info.value.field == "key"


def test_invalid_key_is_invalid_argument() -> None:
    with pytest.raises(InvalidKey) as info:
        parse_key("nope")
    err = info.value
    assert isinstance(err, InvalidArgument)
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    again = pickle.loads(pickle.dumps(err))
    assert again == err and again.field == "key"


# -- constructing keys ----------------------------------------------------


def test_make_key_and_formatting() -> None:
    k = make_key(CPU, GPU, "x", incarnation=0x1234, frame_id=2, iter_id=3)
    assert k == Key(CPU, 0x1234, GPU, "x", 2, 3)
    assert k.format() == f"{CPU};0000000000001234;{GPU};x;2:3"
    assert make_key(CPU, GPU, "x").format() == f"{CPU};0000000000000000;{GPU};x;0:0"
    assert make_key(DeviceName.parse(CPU), DeviceName.parse("/gpu:0"), "x").dst_device == "/gpu:0"
    assert as_key(k) is k
    assert as_key(k.format()) == k
    assert {k: 1}[parse_key(k.format())] == 1  # hashable, equal after round trip


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"src_device": "cpu:0"}, "src_device"),
    ({"src_device": 3}, "src_device"),
    ({"dst_device": "/job:w/task:0"}, "dst_device"),
    ({"dst_device": None}, "dst_device"),
    ({"src_incarnation": -1}, "src_incarnation"),
    ({"src_incarnation": 2**64}, "src_incarnation"),
    ({"src_incarnation": "12"}, "src_incarnation"),
    ({"src_incarnation": 1.0}, "src_incarnation"),
    ({"src_incarnation": True}, "src_incarnation"),
    ({"name": ""}, "name"),
    ({"name": "a;b"}, "name"),
    ({"name": b"x"}, "name"),
    ({"frame_id": -1}, "frame_iter"),
    ({"frame_id": 2**64}, "frame_iter"),
    ({"iter_id": -1}, "frame_iter"),
    ({"iter_id": 2**63}, "frame_iter"),
    ({"iter_id": "0"}, "frame_iter"),
])
def test_key_constructor_validates(kwargs: dict[str, object], field: str) -> None:
    args: dict[str, object] = {"src_device": CPU, "src_incarnation": 1, "dst_device": GPU, "name": "n"}
    args.update(kwargs)
    with pytest.raises(InvalidKey) as info:
        Key(**args)  # type: ignore[arg-type]
    assert info.value.field == field


def test_key_constructor_limits_are_inclusive() -> None:
    k = Key(CPU, 2**64 - 1, GPU, "n", 2**64 - 1, 2**63 - 1)
    assert Key.parse(k.format()) == k


def test_key_normalises_integer_likes() -> None:
    np = pytest.importorskip("numpy")
    k = Key(CPU, np.uint64(2**64 - 1), GPU, "n", np.int64(1), np.int32(2))
    assert type(k.src_incarnation) is int and type(k.frame_id) is int and type(k.iter_id) is int
    assert k == Key(CPU, 2**64 - 1, GPU, "n", 1, 2)


def test_key_is_frozen() -> None:
    k = parse_key(REAL)
    with pytest.raises(AttributeError):
        k.name = "other"  # type: ignore[misc]


def test_parse_key_is_cached() -> None:
    s = key_str(name="cached-edge")
    assert parse_key(s) is parse_key(s)


# -- device names ---------------------------------------------------------


@pytest.mark.parametrize(("s", "expected"), [
    ("/cpu:0", DeviceName(None, None, None, "cpu", 0, True)),
    ("/gpu:1", DeviceName(None, None, None, "gpu", 1, True)),
    ("/GPU:0", DeviceName(None, None, None, "GPU", 0, True)),
    ("/device:CPU:0", DeviceName(None, None, None, "CPU", 0, False)),
    ("/job:ps/replica:0/task:0/cpu:0", DeviceName("ps", 0, 0, "cpu", 0, True)),
    ("/job:worker/replica:1/task:2/device:GPU:3", DeviceName("worker", 1, 2, "GPU", 3, False)),
    ("/job:worker/task:1/device:CPU:0", DeviceName("worker", None, 1, "CPU", 0, False)),
    ("/job:worker/replica:1/device:CPU:0", DeviceName("worker", 1, None, "CPU", 0, False)),
    ("/job:worker/gpu:0", DeviceName("worker", None, None, "gpu", 0, True)),
    ("/task:1/device:CPU:0", DeviceName(None, None, 1, "CPU", 0, False)),
])
def test_device_names(s: str, expected: DeviceName) -> None:
    d = DeviceName.parse(s)
    assert d == expected
    assert str(d) == s


@pytest.mark.parametrize(("s", "task"), [
    ("/cpu:0", None),
    ("/device:GPU:0", None),
    ("/task:3/device:CPU:0", None),
    ("/job:ps/replica:0/task:0/cpu:0", TaskName("ps", 0, 0)),
    ("/job:worker/task:4/device:CPU:0", TaskName("worker", 0, 4)),
    ("/job:worker/replica:2/device:CPU:0", TaskName("worker", 2, 0)),
    ("/job:worker/gpu:0", TaskName("worker", 0, 0)),
])
def test_device_task_name(s: str, task: TaskName | None) -> None:
    assert DeviceName.parse(s).task_name == task


@pytest.mark.parametrize(("s", "gpu"), [
    ("/gpu:0", True), ("/GPU:0", True), ("/device:gpu:0", True), ("/device:Gpu:1", True),
    ("/cpu:0", False), ("/device:XLA_GPU:0", False), ("/device:TPU:0", False),
])
def test_is_gpu(s: str, gpu: bool) -> None:
    assert DeviceName.parse(s).is_gpu is gpu


@pytest.mark.parametrize("s", ["", "cpu:0", "/job:w/task:0", "/cpu:01", "/job:w/job:w/cpu:0", "/replica:0"])
def test_invalid_device_names_carry_the_field(s: str) -> None:
    with pytest.raises(InvalidKey) as info:
        DeviceName.parse(s)
    assert info.value.field == "device"
    assert repr(s) in info.value.message
    with pytest.raises(InvalidKey) as info:
        DeviceName.parse(s, field="dst_device")
    assert info.value.field == "dst_device"


def test_device_name_non_string() -> None:
    with pytest.raises(InvalidKey) as info:
        DeviceName.parse(None, field="src_device")  # type: ignore[arg-type]
    assert info.value.field == "src_device"


# -- task names -----------------------------------------------------------


@pytest.mark.parametrize(("s", "expected"), [
    ("/job:worker/replica:0/task:0", TaskName("worker", 0, 0)),
    ("/job:ps/replica:3/task:12", TaskName("ps", 3, 12)),
    ("/job:worker/task:5", TaskName("worker", 0, 5)),
])
def test_task_names(s: str, expected: TaskName) -> None:
    assert TaskName.parse(s) == expected
    assert TaskName.parse(str(expected)) == expected


def test_task_name_str() -> None:
    assert str(TaskName("worker", 1, 2)) == "/job:worker/replica:1/task:2"


@pytest.mark.parametrize("s", [
    "", "/job:worker", "/job:worker/replica:0", "job:worker/task:0", "/job:worker/task:0/",
    "/job:worker/replica:0/task:0/device:CPU:0", "/job:1w/task:0", "/job:w/task:-1", "/job:w/task:01",
    "/task:0/job:w", "/job:w/replica:x/task:0", "/job:w/task:0/replica:0", "/job:w/task:",
])
def test_invalid_task_names(s: str) -> None:
    with pytest.raises(InvalidKey) as info:
        TaskName.parse(s)
    assert info.value.field == "task"


# -- properties -----------------------------------------------------------

_IDENT_START = st.sampled_from("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_IDENT_REST = st.text("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_", max_size=8)
idents = st.builds(lambda a, b: a + b, _IDENT_START, _IDENT_REST)
small_ints = st.integers(0, 2**31 - 1)
legacy_types = idents.filter(lambda t: t.lower() not in {"job", "replica", "task", "device"})


@st.composite
def device_names(draw: st.DrawFn) -> DeviceName:
    legacy = draw(st.booleans())
    return DeviceName(
        job=draw(st.none() | idents),
        replica=draw(st.none() | small_ints),
        task=draw(st.none() | small_ints),
        type=draw(legacy_types if legacy else idents),
        id=draw(small_ints),
        legacy=legacy,
    )


edge_names = st.text(min_size=1, max_size=40).map(lambda s: s.replace(";", "")).filter(bool)

keys = st.builds(
    Key,
    src_device=device_names().map(str),
    src_incarnation=st.integers(0, 2**64 - 1),
    dst_device=device_names().map(str),
    name=edge_names,
    frame_id=st.integers(0, 2**64 - 1),
    iter_id=st.integers(0, 2**63 - 1),
)

PROPS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(device_names())
def test_device_name_round_trip(d: DeviceName) -> None:
    assert DeviceName.parse(str(d)) == d
    assert str(DeviceName.parse(str(d))) == str(d)


@PROPS
@given(keys)
def test_key_round_trip(k: Key) -> None:
    s = k.format()
    assert Key.parse(s) == k
    assert Key.parse(s).format() == s
    assert parse_key(s) == k
    assert k.src_task == DeviceName.parse(k.src_device).task_name


@PROPS
@given(keys, st.integers(0, 16), st.booleans())
def test_short_or_uppercase_incarnation(k: Key, zeros: int, upper: bool) -> None:
    digits = f"{k.src_incarnation:x}"
    written = "0" * min(zeros, 16 - len(digits)) + digits
    parts = k.format().split(";")
    parts[1] = written.upper() if upper else written
    k2 = Key.parse(";".join(parts))
    assert k2 == k
    assert k2.format() == k.format()


_KEYISH = "/:;0123456789abcdefxABCDEF -_jobreplicatskdvicepugCPUGPU\u0661\n"


@PROPS
@given(st.one_of(
    st.text(max_size=80),
    st.text(_KEYISH, max_size=80),
    st.lists(st.text(_KEYISH, max_size=20), min_size=5, max_size=5).map(";".join),
    keys.map(Key.format).flatmap(
        lambda s: st.tuples(st.integers(0, len(s)), st.integers(0, len(s)), st.text(_KEYISH, max_size=3)).map(
            lambda t: s[:t[0]] + t[2] + s[t[1]:])),
))
def test_random_text_parses_or_raises_invalid_key(s: str) -> None:
    try:
        k = Key.parse(s)
    except InvalidKey as exc:
        assert exc.field in {"key", "src_device", "src_incarnation", "dst_device", "name", "frame_iter"}
        assert "invalid rendezvous key" in exc.message
    else:
        assert Key.parse(k.format()) == k
        assert parse_key(s) == k
