"""The GGUF header reader (pagedserve.engine.model.gguf_header) against the `gguf` package's
GGUFReader on a file written by its GGUFWriter: the same scalar metadata, the same tensor names,
types and sizes, with string and number arrays stepped over; a file that is not a GGUF, or is
cut short, is a ValueError."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.engine.model.gguf_header import read_gguf_header

gguf = pytest.importorskip("gguf")


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_block_count(2)
    writer.add_rope_freq_base(1000000.0)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_token_list(["<s>", "a", "bé", "long token " * 20])
    writer.add_token_types([3, 1, 1, 1])
    writer.add_array("test.numbers", [1.5, 2.5])
    writer.add_string("general.name", "tiny ünïcode")
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor(
        "token_embd.weight", gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), q8), raw_dtype=q8
    )
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up_exps.weight", rng.standard_normal((2, 4, 32)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_header_matches_gguf_readers(written):
    header = read_gguf_header(written)
    reader = gguf.GGUFReader(str(written))
    expected = {
        k: f.contents()
        for k, f in reader.fields.items()
        if f.types[0] != gguf.GGUFValueType.ARRAY and not k.startswith("GGUF.")
    }
    assert header.fields == expected
    assert header.fields["general.architecture"] == "qwen3" and header.fields["general.name"] == "tiny ünïcode"
    assert "tokenizer.ggml.tokens" not in header.fields
    assert [(t.name, t.type_name, t.n_elements) for t in header.tensors] == [
        (t.name, t.tensor_type.name, int(t.n_elements)) for t in reader.tensors
    ]
    assert [t.type_name for t in header.tensors] == ["Q8_0", "F32", "F16"]


def test_not_a_gguf_or_cut_short_is_a_value_error(written, tmp_path):
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="no GGUF magic"):
        read_gguf_header(other)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(written.read_bytes()[:200])
    with pytest.raises(ValueError, match="cut short"):
        read_gguf_header(cut)
