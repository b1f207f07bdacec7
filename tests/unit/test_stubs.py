"""The committed protobuf stubs are exactly what protoc generates from proto/."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("proto_generate", ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = module.generate(tmp_path)
    assert len(generated) == 12  # 4 protos x (pb2, pyi, grpc)
    for path in generated:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is not committed; run python proto/generate.py"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale; run python proto/generate.py"
