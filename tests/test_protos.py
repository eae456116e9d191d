"""The committed generated modules are exactly what protos/ generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "tools" / "gen_protos.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_code_matches_protos(tmp_path):
    written = _generator().generate(tmp_path)
    assert written, "no .proto files found"
    for fresh in written:
        committed = ROOT / fresh.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is missing: run `make protos`"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.relative_to(ROOT)} differs from what protos/ generates: run `make protos`")
    generated = {p.relative_to(tmp_path) for p in written}
    stale = [p for p in (ROOT / "rendezvous" / "v1").glob("*_pb2*")
             if p.relative_to(ROOT) not in generated]
    assert not stale, f"generated files with no .proto: {stale}"


def test_wire_field_numbers_match_tensorflow():
    from rendezvous.v1 import rendezvous_pb2 as pb

    req = {f.name: f.number for f in pb.RecvTensorRequest.DESCRIPTOR.fields}
    assert req == {"step_id": 1, "rendezvous_key": 2, "dma_ok": 3, "transport_options": 6, "request_id": 7}
    resp = {f.name: f.number for f in pb.RecvTensorResponse.DESCRIPTOR.fields}
    assert resp == {"tensor": 1, "is_dead": 2, "send_start_micros": 3, "transport_options": 4}
    assert pb.RecvTensorRequest.DESCRIPTOR.fields_by_name["transport_options"].message_type.full_name == \
        "google.protobuf.Any"


def test_tensor_proto_matches_tensorflow_descriptor():
    """Every field we declare has TensorFlow's number and type."""
    from tensorboard.compat.proto import tensor_pb2 as tf
    from tensorboard.compat.proto import types_pb2 as tf_types

    from rendezvous.v1 import tensor_pb2 as ours

    tf_fields = {f.name: (f.number, f.type) for f in tf.TensorProto.DESCRIPTOR.fields}
    for f in ours.TensorProto.DESCRIPTOR.fields:
        assert tf_fields[f.name] == (f.number, f.type), f.name
    for v in ours.DataType.DESCRIPTOR.values:
        assert tf_types.DataType.Value(v.name) == v.number, v.name
