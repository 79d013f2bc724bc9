"""Decoder blocks streamed from host memory (inference/streaming.py) compute what resident ones
do, whichever blocks and however many are streamed, through prefill chunks, decode steps and
continuous batching; the device holds two block buffers and the host the rest. The GPU's
overlap of copies and compute is timed by bench/decode_gpu.py."""

import pytest
import torch

from slimlm.compress.quantize import QuantizeParams
from slimlm.compress.quantize import run as quantize
from slimlm.errors import SlimlmError
from slimlm.inference.decoder import Decoder
from slimlm.inference.load import load_decoder
from slimlm.inference.model import Segment
from slimlm.inference.sampling import SamplingParams
from slimlm.inference.streaming import HostEmbedding, Placement, streamed_layers
from slimlm.inference.synthetic import random_decoder
from slimlm.pipeline import RunState
from slimlm.qlinear import QuantScheme
from tests.test_artifact import export

CONFIG = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}


@pytest.mark.parametrize("count", [1, 2, 3, 5], ids=lambda c: f"{c}-streamed")
def test_streamed_blocks_give_the_resident_decoders_tokens_and_logits(count):
    scheme = QuantScheme(bits=4, group_size=32)
    resident = random_decoder(CONFIG, scheme, scheme, dtype=torch.float32)
    streamed = random_decoder(
        CONFIG, scheme, scheme, dtype=torch.float32, placement=Placement(count, table_on_host=True)
    )
    streamer = streamed.streamer
    assert (
        isinstance(streamed.embedding, HostEmbedding)
        and streamed.weight_bytes() == resident.weight_bytes() - streamed.embedding.host_table.nbytes
    )
    assert len(streamer.hosts) == count and len(streamer.buffers) == min(2, count)
    block_bytes = streamer.hosts[0].host.numel()
    assert streamer.host_bytes == count * block_bytes and streamer.device_bytes == min(2, count) * block_bytes
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(count))
    with torch.inference_mode():
        for model in (resident, streamed):
            model.setup_cache(2, 40)
        torch.testing.assert_close(streamed(tokens[:, :16], 0), resident(tokens[:, :16], 0), rtol=0, atol=0)
        for slot in range(
            16, 24
        ):  # decode steps: every block runs each step, the prefetch chain wraps around
            torch.testing.assert_close(
                streamed(tokens[:, slot : slot + 1], slot),
                resident(tokens[:, slot : slot + 1], slot),
                rtol=0,
                atol=0,
            )
        segments = [
            Segment(1, 24, [int(tokens[0, -1])]),
            Segment(0, 24, [int(tokens[1, -1])]),
        ]  # continuous batching's rows at their own slots
        for mine, theirs in zip(
            streamed.forward_segments(segments, [1, 1]), resident.forward_segments(segments, [1, 1])
        ):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = tokens[0, :10].tolist()

    class Ids:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return ""

    assert (
        Decoder(streamed, Ids()).generate_ids([prompt], params)[0].token_ids
        == Decoder(resident, Ids()).generate_ids([prompt], params)[0].token_ids
    )
    with pytest.raises(SlimlmError, match="streams layers"):
        Decoder(streamed, Ids()).compile_decode_step()


def test_a_pass_that_raises_does_not_leave_a_block_with_anothers_weights():
    """A streamed block that raises midway (out of memory in a prefill chunk, say) leaves the
    next block's weights in a buffer the next pass's first block reads: that block copies its
    own again, and the next pass computes what the resident decoder does."""
    scheme = QuantScheme(bits=4, group_size=32)
    resident = random_decoder(CONFIG, scheme, scheme, dtype=torch.float32)
    streamed = random_decoder(CONFIG, scheme, scheme, dtype=torch.float32, placement=Placement(3))
    failing = streamed.streamer.hosts[
        1
    ].block  # its pre-hook has copied the third streamed block over the first's buffer

    def out_of_memory(module, args):
        raise RuntimeError("out of memory")

    hook = failing.register_forward_pre_hook(out_of_memory)
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        for model in (resident, streamed):
            model.setup_cache(1, 16)
        with pytest.raises(RuntimeError, match="out of memory"):
            streamed(tokens, 0)
        hook.remove()
        torch.testing.assert_close(streamed(tokens, 0), resident(tokens, 0), rtol=0, atol=0)


def test_a_streamed_block_keeps_a_2_4_sparse_weight_dense(monkeypatch):
    """torch's compressed 2:4 weight is no plain bytes to copy from host memory: where the GPU's
    sparse kernel would serve a layer, a streamed block keeps the dense weight. (Stood in for
    on the CPU: every float layer passes as 2:4, and a dense layer stands for the sparse one.)"""
    from slimlm.inference import linear

    class Sparse(linear.DenseLinear):
        pass

    monkeypatch.setattr(linear, "semi_sparse_fits", lambda weight, dtype, device: True)
    monkeypatch.setattr(linear, "SemiSparseLinear", Sparse)
    decoder = random_decoder(CONFIG, None, None, dtype=torch.float32, placement=Placement(2))
    kinds = [
        {
            type(layer)
            for layer in (b.attention.qkv, b.attention.o_proj, b.feed_forward.gate_up, b.feed_forward.down)
        }
        for b in decoder.layers
    ]
    assert kinds == [{Sparse}] * 3 + [{linear.DenseLinear}] * 2


def test_an_artifact_loads_with_its_last_blocks_in_host_memory(context_model, tiny_tokenizer, tmp_path):
    state = RunState(
        cfg=None,
        run_dir=tmp_path,
        model=context_model,
        tokenizer=tiny_tokenizer,
        source=None,
        source_sha256=None,
        device=torch.device("cpu"),
    )
    quantize(state, QuantizeParams(bits=4, group_size=32, targets=[r"model\.layers\.\d+\..*", "lm_head"]))
    path = export(state, tmp_path / "artifact")
    resident, _ = load_decoder(path, dtype=torch.float32)
    streamed, _ = load_decoder(path, dtype=torch.float32, placement=Placement(stream_layers=1))
    assert [host.block for host in streamed.streamer.hosts] == [
        streamed.layers[i] for i in streamed_layers(len(streamed.layers), 1)
    ]
    tokens = torch.randint(0, context_model.config.vocab_size, (1, 12))
    with torch.inference_mode():
        for model in (resident, streamed):
            model.setup_cache(1, 16)
        torch.testing.assert_close(streamed(tokens, 0), resident(tokens, 0), rtol=0, atol=0)
