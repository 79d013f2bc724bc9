"""The memory planner: will a model fit a device, and how fast can it decode there?

From a model's config and its layers' schemes alone (no weights read), for a hardware profile,
a context length and a batch: the bytes the bundled decoder holds for weights (in the layouts
inference/linear.py builds), the static key/value cache, the activations of a prefill chunk and
the last position's logits, and the runtime's reserve. Then a plan, the first that fits:

  1. everything on the device;
  2. for a mixture of experts, the routed experts stay in host memory and run on the CPU
     (attention, norms, routers and dense MLPs on the device): llama.cpp's `--cpu-moe`;
  3. the decoder layers that do not fit stay in pinned host memory and are streamed to the
     device one layer ahead of use (two layer buffers on the device);
  4. a shorter context (halved, down to 256 tokens), tried the same ways;
  5. nothing fits: a refusal that gives the numbers and what was tried.

Decode speed is bounded by bandwidth: each token reads every weight once (the embedding table
one row; of a mixture of experts, the routed experts' top_k of E) and the cache so far; streamed
layers cross the host link instead of device memory, and host experts are read by the CPU at
host memory bandwidth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from typing import Optional

from slimlm.architecture import family_of as compression_family
from slimlm.errors import SlimlmError
from slimlm.inference import cpu_kernels, gpu_kernels
from slimlm.inference.linear import int8pack_fits, tinygemm_fits
from slimlm.inference.model import ModelArgs
from slimlm.inference.streaming import Placement, streamed_layers
from slimlm.qlinear import QuantScheme

GiB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    device: str  # "cuda" or "cpu"
    memory_bytes: int
    reserve_bytes: (
        int  # what the runtime takes before any tensor: CUDA context and workspace, or the Python process
    )
    bandwidth_bytes_s: float  # device memory bandwidth
    host_link_bytes_s: Optional[float] = None  # host-to-device copies (PCIe) for streamed layers
    host_bandwidth_bytes_s: Optional[float] = None  # the CPU reading host memory: experts computed there
    host_memory_bytes: Optional[int] = None  # what host memory can hold beside the OS and the process


HARDWARE = {
    # An 8 GB laptop GPU: about 0.8 GiB goes to the CUDA context, cuBLAS workspace and allocator
    # slack. Its host: 32 GB of dual-channel DDR5 (about 60 GB/s read), 26 GiB of it free.
    "laptop-8gb": Hardware("laptop-8gb", "cuda", 8 * GiB, int(0.8 * GiB), 256e9, 12e9, 60e9, 26 * GiB),
    "laptop-8gb-448": Hardware(
        "laptop-8gb-448", "cuda", 8 * GiB, int(0.8 * GiB), 448e9, 12e9, 60e9, 26 * GiB
    ),
    "h200": Hardware("h200", "cuda", 141 * 10**9, 1 * GiB, 4.8e12, 50e9, 200e9, 1000 * GiB),
    # A 16 GB laptop's CPU: the Python process with torch and transformers takes about 0.6 GiB.
    "cpu": Hardware("cpu", "cpu", 16 * GiB, int(0.6 * GiB), 33e9),
}


def preset_names() -> list[str]:
    """The model shapes known by name (slimlm/assets/configs): `slimlm plan llama-3-8b`."""
    return sorted(
        entry.name.removesuffix(".json")
        for entry in resources.files("slimlm.assets").joinpath("configs").iterdir()
        if entry.name.endswith(".json")
    )


def preset_config(name: str) -> dict:
    """The HF-style config (a dict) of a preset shape."""
    if name not in preset_names():
        raise SlimlmError(f"no model preset named '{name}'; known: {', '.join(preset_names())}")
    return json.loads(resources.files("slimlm.assets").joinpath("configs", f"{name}.json").read_text())


def packed_bytes(out_features: int, in_features: int, scheme: QuantScheme) -> int:
    """A QuantLinear's storage: b-bit codes, fp16 scales and uint8 zero points per group."""
    groups = scheme.groups(in_features)
    return out_features * in_features * scheme.bits // 8 + out_features * groups * (
        2 + (0 if scheme.symmetric else 1)
    )


def matvec_fits(scheme: Optional[QuantScheme], in_features: int) -> bool:
    """Whether slimlm's Triton int4 kernel holds a layer of this scheme (GPU, gpu_int4="triton")."""
    return scheme is not None and gpu_kernels.fits(scheme.bits, scheme.group_size, in_features)


def linear_bytes(
    out_features: int,
    in_features: int,
    scheme: Optional[QuantScheme],
    act_bytes: int,
    matvec: bool = False,
    int8_activations: bool = False,
) -> int:
    """Bytes of one linear layer as the decoder stores it (inference/linear.py); `matvec`: int4
    layers run in slimlm's Triton kernel, which keeps the stored packing; `int8_activations`:
    int4 and int8 layers run in slimlm's CPU kernels (a bf16 scale per group or row, and an
    offset where the scheme is asymmetric)."""
    if scheme is None:
        return out_features * in_features * act_bytes
    if matvec and matvec_fits(scheme, in_features):
        return packed_bytes(out_features, in_features, scheme)
    if int8_activations and cpu_kernels.fits(scheme, out_features, in_features):
        return (
            out_features * in_features * scheme.bits // 8
            + (1 if scheme.symmetric else 2) * scheme.groups(in_features) * out_features * 2
        )
    if tinygemm_fits(scheme, in_features):
        return (
            out_features * in_features // 2 + 2 * scheme.groups(in_features) * out_features * act_bytes
        )  # codes; (scale, zero) per group
    if int8pack_fits(scheme):  # int8 codes; a scale (and an offset) per row
        return out_features * in_features + out_features * act_bytes * (1 if scheme.symmetric else 2)
    return packed_bytes(out_features, in_features, scheme)  # dequantized on each call


@dataclass
class Budget:
    """Bytes by component and the decode-speed bound they imply."""

    layer_bytes: list[int]
    head_bytes: int
    table_bytes: int  # the embedding table (read one row per token); 0 when it is the head
    norm_bytes: int
    kv_bytes: int
    activation_bytes: int
    reserve_bytes: int
    transit_bytes: int = 0  # CPU loading: the largest layer held in its stored and its kernel layout at once
    expert_bytes: list[int] = field(
        default_factory=list
    )  # each layer's routed experts (part of layer_bytes; 0 for a dense layer)
    routed_fraction: float = 1.0  # of the routed experts, the share a token reads: top_k / experts

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.head_bytes + self.table_bytes + self.norm_bytes

    @property
    def all_expert_bytes(self) -> int:
        return sum(self.expert_bytes)

    @property
    def total_bytes(self) -> int:
        # the load's transient is over before the cache is allocated: the larger of the two counts
        return (
            self.weight_bytes
            + self.reserve_bytes
            + max(self.kv_bytes + self.activation_bytes, self.transit_bytes)
        )


@dataclass
class Plan:
    hardware: Hardware
    context: int
    batch: int
    budget: Budget
    kind: str  # "device", "stream", "shorter-context"
    streamed_layers: int = 0
    table_on_host: bool = False  # an untied embedding table is read one row per token: host memory serves
    experts_on_host: bool = False  # a mixture of experts' routed experts stay in host memory, run by the CPU
    notes: list[str] = field(default_factory=list)

    @property
    def placement(self) -> Placement:
        """What this plan keeps in host memory, for build_decoder / load_decoder."""
        return Placement(
            self.streamed_layers if self.kind == "stream" else 0, self.table_on_host, self.experts_on_host
        )

    def streamed_bytes(self) -> list[int]:
        """The bytes of each block kept in host memory: the ones the decoder streams
        (streaming.streamed_layers)."""
        layers = self.budget.layer_bytes
        return (
            [layers[i] for i in streamed_layers(len(layers), self.streamed_layers)]
            if self.kind == "stream"
            else []
        )

    def device_bytes(self) -> int:
        """Peak bytes on the device (or in RAM for CPU plans): the streamed blocks pass through
        two buffers (one with one streamed block), each the size of the largest of them."""
        b, streamed = self.budget, self.streamed_bytes()
        total = b.total_bytes - (b.table_bytes if self.table_on_host else 0) - self.host_expert_bytes()
        return total - sum(streamed) + min(2, len(streamed)) * max(streamed, default=0)

    def host_expert_bytes(self) -> int:
        return self.budget.all_expert_bytes if self.experts_on_host else 0

    def host_bytes(self) -> int:
        """What this plan keeps in host memory beyond the process itself."""
        return (
            sum(self.streamed_bytes())
            + self.host_expert_bytes()
            + (self.budget.table_bytes if self.table_on_host else 0)
        )

    def fits(self) -> bool:
        host = self.hardware.host_memory_bytes
        return self.device_bytes() <= self.hardware.memory_bytes and (
            host is None or self.host_bytes() <= host
        )

    def decode_tok_s_bound(self) -> float:
        """Tokens per second per sequence at batch 1 if every byte moved at full bandwidth."""
        b, hw = self.budget, self.hardware
        per_token_kv = b.kv_bytes / self.batch / 2  # the cache is half full on average
        streamed = sum(self.streamed_bytes())
        unread_experts = b.all_expert_bytes * (
            1 - b.routed_fraction
        )  # the experts no token of this step chose
        host_experts = self.host_expert_bytes() * b.routed_fraction
        device_read = b.weight_bytes - b.table_bytes - streamed - unread_experts - host_experts + per_token_kv
        seconds = device_read / hw.bandwidth_bytes_s + (streamed / hw.host_link_bytes_s if streamed else 0)
        if host_experts:
            seconds += host_experts / hw.host_bandwidth_bytes_s
        return 1 / seconds


SEPARATE = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
STORED_FUSED = (
    ("self_attn.qkv_proj",),
    ("self_attn.o_proj",),
    ("mlp.gate_up_proj",),
    ("mlp.down_proj",),
)  # phi3's checkpoints


def linear_groups(args: ModelArgs, index: int = 0) -> tuple[tuple[str, ...], ...]:
    """Decoder layer `index`'s Linear layers as the family's checkpoints name them, grouped as
    the decoder fuses them into one matmul each; a mixture of experts' MLP is each expert's
    gate/up and down."""
    groups = STORED_FUSED if args.family.stored_fused else SEPARATE
    if not args.is_expert_layer(index):
        return groups
    names = compression_family(args.architecture).experts
    experts = (
        ((f"mlp.experts.{e}.{names.gate}", f"mlp.experts.{e}.{names.up}"), (f"mlp.experts.{e}.{names.down}",))
        for e in range(args.routing.experts)
    )
    return groups[:2] + tuple(group for pair in experts for group in pair)


def linear_shape(args: ModelArgs, name: str) -> tuple[int, int]:
    """A decoder-layer Linear's (out_features, in_features), by its name in the layer."""
    q, kv, inner = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.intermediate_size
    if name.startswith("mlp.experts."):
        size, down = args.routing.expert_size, compression_family(args.architecture).experts.down
        return (args.dim, size) if name.endswith(f".{down}") else (size, args.dim)
    return {
        "self_attn.q_proj": (q, args.dim),
        "self_attn.k_proj": (kv, args.dim),
        "self_attn.v_proj": (kv, args.dim),
        "self_attn.qkv_proj": (q + 2 * kv, args.dim),
        "self_attn.o_proj": (args.dim, q),
        "mlp.gate_proj": (inner, args.dim),
        "mlp.up_proj": (inner, args.dim),
        "mlp.gate_up_proj": (2 * inner, args.dim),
        "mlp.down_proj": (args.dim, inner),
    }[name]


TABLE = "model.embed_tokens"  # an untied input embedding quantized with its head (compress/quantize.py)


def tile_columns(outs: list[int], ranks: list[int]) -> int:
    """How many columns of a fused adapter's block-diagonal up-projection cpu_kernels.pack_adapter
    stores over all tiles of 16 rows: each tile keeps the span from the first to the last column
    its rows use, so a tile that straddles two parts keeps both parts' columns."""
    parts, row, column = [], 0, 0
    for out, rank in zip(outs, ranks):
        if rank:
            parts.append((row, row + out, column, column + rank))
        row, column = row + out, column + rank
    total = 0
    for start in range(0, row, cpu_kernels.TILE):
        used = [
            (first, last)
            for top, bottom, first, last in parts
            if top < start + cpu_kernels.TILE and bottom > start
        ]
        if used:
            total += max(last for _, last in used) - min(first for first, _ in used)
    return total


def adapter_bytes(
    shapes: list[tuple[int, int]],
    schemes: list[Optional[QuantScheme]],
    ranks: list[int],
    element_bytes: int,
    int8_activations: bool = False,
) -> int:
    """The LoRA adapters of layers that read one input (inference/linear.py): one adapter of the
    ranks' sum when the layers fuse (one quantized scheme), otherwise each its own. Beside a
    kernel its up-projection is a block diagonal of `element_bytes` values; inside the
    int8-activation kernels (`int8_activations`, where the scheme fits) both factors are bf16,
    each tile of 16 rows keeps only the columns its parts use (tile_columns), and three int64
    per tile say where."""
    units = (
        [(shapes, ranks, schemes[0])]
        if len(set(schemes)) == 1 and schemes[0] is not None
        else [([shape], [rank], scheme) for shape, rank, scheme in zip(shapes, ranks, schemes)]
    )
    total = 0
    for unit_shapes, unit_ranks, scheme in units:
        rank, width, rows = sum(unit_ranks), unit_shapes[0][1], sum(out for out, _ in unit_shapes)
        if not rank:
            continue
        if int8_activations and cpu_kernels.fits(scheme, rows, width):
            total += (
                2
                * (
                    rank * width
                    + cpu_kernels.TILE * tile_columns([out for out, _ in unit_shapes], unit_ranks)
                )
                + 3 * 8 * rows // cpu_kernels.TILE
            )
        else:
            total += rank * (width + rows) * element_bytes
    return total


@dataclass(frozen=True)
class Storage:
    """How the decoder stores weights, adapters and its cache on a hardware, for budget's steps."""

    matvec: bool  # int4 layers run in slimlm's Triton kernel (GPU, gpu_int4="triton")
    int8_kernels: bool  # int4 and int8 layers run in slimlm's int8-activation kernels (CPU)
    act_bytes: int  # bf16/fp16 activations: the fast path of every packed kernel
    float_kv: int  # a float cache's element: the CPU cache is fp32 (inference/model.py)
    adapter_element: int  # CPU adapters beside torch's kernels run in fp32 (inference/linear.py)

    @classmethod
    def of(cls, hardware: Hardware, int8_activations: bool, gpu_int4: str) -> Storage:
        act_bytes = 2
        on_gpu = hardware.device == "cuda"
        return cls(
            matvec=on_gpu and gpu_int4 == "triton",
            int8_kernels=int8_activations and hardware.device == "cpu",
            act_bytes=act_bytes,
            float_kv=act_bytes if on_gpu else 4,
            adapter_element=act_bytes if on_gpu else 4,
        )


def budget(
    args: ModelArgs,
    schemes: dict[str, QuantScheme],
    hardware: Hardware,
    context: int,
    batch: int,
    prefill_chunk: int = 512,
    int8_activations: bool = False,
    kv_int8: bool = False,
    gpu_int4: str = "tinygemm",
    adapter_ranks: Optional[dict[str, int]] = None,
) -> Budget:
    """The decoder's bytes for this model on this hardware. `schemes` maps module names
    (`model.layers.0.self_attn.q_proj`, `lm_head`) to schemes; absent modules stay float.
    `int8_activations` (CPU): int4 and int8 layers run in slimlm's int8-activation kernels, whose
    layout a tied head's embedding reads row by row (no second table). `kv_int8`: the cache holds int8
    codes and a float32 scale per head and slot, and a step reads one layer's cache dequantized.
    `gpu_int4="triton"` (GPU): int4 layers keep their stored packing (inference/gpu_kernels.py),
    a tied head serves as the embedding, and a prefill chunk dequantizes one layer at a time.
    `adapter_ranks`: the rank of the LoRA adapter beside each quantized layer that has one."""
    adapter_ranks = adapter_ranks or {}
    storage = Storage.of(hardware, int8_activations, gpu_int4)
    sizes = [layer_bytes(args, index, schemes, adapter_ranks, storage) for index in range(args.n_layers)]
    layers, experts = [total for total, _ in sizes], [routed for _, routed in sizes]
    head = head_bytes(args, schemes, adapter_ranks, storage)
    # Loading on a CPU holds the largest layer in its stored and its kernel layout at once (the
    # stored copy is dropped before the next is read); a GPU plan leaves that host-side.
    transit = max(*layers, head) if hardware.device == "cpu" else 0
    fraction = args.routing.top_k / args.routing.experts if args.routing else 1.0
    return Budget(
        layers,
        head,
        table_bytes(args, schemes, storage),
        args.dim * storage.act_bytes,
        kv_cache_bytes(args, context, batch, kv_int8, storage),
        activation_bytes(args, schemes, context, batch, prefill_chunk, kv_int8, storage),
        hardware.reserve_bytes,
        transit,
        experts,
        fraction,
    )


def layer_bytes(
    args: ModelArgs,
    index: int,
    schemes: dict[str, QuantScheme],
    adapter_ranks: dict[str, int],
    storage: Storage,
) -> tuple[int, int]:
    """Decoder layer `index`'s bytes (norms, router, linear layers with their biases and
    adapters), and of them its routed experts' (0 for a dense layer)."""
    act_bytes = storage.act_bytes
    total = qk_norm_bytes(args, act_bytes) + len(args.family.norms) * args.dim * act_bytes
    if args.is_expert_layer(index):
        total += args.routing.experts * args.dim * 4  # the router, fp32
    routed = 0
    for group in linear_groups(args, index):
        names = [f"model.layers.{index}.{name}" for name in group]
        shapes = [linear_shape(args, name) for name in group]
        ranks = [adapter_ranks.get(name, 0) for name in names]
        part = adapter_bytes(
            shapes,
            [schemes.get(name) for name in names],
            ranks,
            storage.adapter_element,
            storage.int8_kernels,
        )
        for name, (out_features, in_features) in zip(group, shapes):
            part += linear_bytes(
                out_features,
                in_features,
                schemes.get(f"model.layers.{index}.{name}"),
                act_bytes,
                storage.matvec,
                storage.int8_kernels,
            )
            if args.qkv_bias and name.startswith("self_attn.") and name != "self_attn.o_proj":
                part += out_features * act_bytes
        total += part
        routed += part if group[0].startswith("mlp.experts.") else 0
    return total, routed


def head_bytes(
    args: ModelArgs, schemes: dict[str, QuantScheme], adapter_ranks: dict[str, int], storage: Storage
) -> int:
    """The LM head's bytes, with its adapter."""
    head_scheme = schemes.get("lm_head")
    head = linear_bytes(
        args.vocab_size, args.dim, head_scheme, storage.act_bytes, storage.matvec, storage.int8_kernels
    )
    return head + adapter_bytes(
        [(args.vocab_size, args.dim)],
        [head_scheme],
        [adapter_ranks.get("lm_head", 0)],
        storage.adapter_element,
        storage.int8_kernels,
    )


def table_bytes(args: ModelArgs, schemes: dict[str, QuantScheme], storage: Storage) -> int:
    """The input embedding table's bytes; 0 where the head's layout serves as the table."""
    head_scheme = schemes.get("lm_head")
    table_scheme = schemes.get(TABLE)
    if not args.tie_embeddings:
        return (
            args.vocab_size * args.dim * storage.act_bytes
            if table_scheme is None
            else packed_bytes(args.vocab_size, args.dim, table_scheme)
        )  # a quantized table keeps its stored packing
    if storage.int8_kernels and cpu_kernels.fits(head_scheme, args.vocab_size, args.dim):
        return 0
    if storage.matvec and matvec_fits(head_scheme, args.dim):
        return 0  # the head's stored codes are read by rows
    if tinygemm_fits(head_scheme, args.dim):
        return packed_bytes(
            args.vocab_size, args.dim, head_scheme
        )  # a tinygemm head cannot be read by rows: the packed codes again
    return 0


def kv_cache_bytes(args: ModelArgs, context: int, batch: int, kv_int8: bool, storage: Storage) -> int:
    """The static key/value cache: every layer's keys and values for `batch` rows of `context` slots."""
    per_slot = args.n_kv_heads * (
        args.head_dim + 4 if kv_int8 else args.head_dim * storage.float_kv
    )  # bytes of one slot's keys
    return 2 * args.n_layers * per_slot * context * batch


def activation_bytes(
    args: ModelArgs,
    schemes: dict[str, QuantScheme],
    context: int,
    batch: int,
    prefill_chunk: int,
    kv_int8: bool,
    storage: Storage,
) -> int:
    """The activations of a prefill chunk and the last position's logits."""
    act_bytes = storage.act_bytes
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    tokens = batch * min(prefill_chunk, context)
    inner = (
        max(args.intermediate_size, args.routing.top_k * args.routing.expert_size)
        if args.routing
        else args.intermediate_size
    )
    hidden = tokens * (4 * args.dim + q + 2 * kv + 3 * inner) * act_bytes
    if kv_int8:
        hidden += 2 * batch * context * kv * storage.float_kv
    if storage.matvec and any(matvec_fits(scheme, args.dim) for scheme in schemes.values()):
        # a prefill chunk multiplies by a dequantized weight: the largest fused layer's unpacked
        # codes (a byte each) and two activation-dtype copies while it is scaled
        hidden += 2 * args.intermediate_size * args.dim * (1 + 2 * act_bytes)
    logits = batch * args.vocab_size * 4
    return hidden + logits


def qk_norm_bytes(args: ModelArgs, act_bytes: int) -> int:
    """A layer's query and key norms: one head's width each, or the projections' (OLMoE)."""
    if args.family.qk_norm == "projection":
        return (args.n_heads + args.n_kv_heads) * args.head_dim * act_bytes
    return 2 * args.head_dim * act_bytes if args.family.qk_norm else 0


TABLE_NOTE = (
    "the embedding table stays in host memory (one row per token is copied over): "
    "run with --embedding-on-host"
)


def make_plan(
    args: ModelArgs,
    schemes: dict[str, QuantScheme],
    hardware: Hardware,
    context: int,
    batch: int = 1,
    int8_activations: bool = False,
    kv_int8: bool = False,
    gpu_int4: str = "tinygemm",
    adapter_ranks: Optional[dict[str, int]] = None,
) -> Plan:
    """The first plan that fits (see the module docstring), or SlimlmError with the numbers."""
    if context < 1 or batch < 1:
        raise SlimlmError(f"context ({context}) and batch ({batch}) must be at least 1")
    if context > args.max_position_embeddings:
        raise SlimlmError(f"a context of {context} is longer than the model's {args.max_position_embeddings}")
    host_table = (
        hardware.device == "cuda" and not args.tie_embeddings and TABLE not in schemes
    )  # a quantized table is small: on the device
    contexts = [context]
    while contexts[-1] > 256:  # halving, not below 256 tokens: a shorter context is of little use
        contexts.append(contexts[-1] // 2)
    attempts = []  # the plans tried at each context, for the refusal
    for length in contexts:
        b = budget(
            args,
            schemes,
            hardware,
            length,
            batch,
            int8_activations=int8_activations,
            kv_int8=kv_int8,
            gpu_int4=gpu_int4,
            adapter_ranks=adapter_ranks,
        )
        attempts.append(candidate_plans(args, hardware, b, length, context, batch, host_table))
        fits = next((plan for plan in attempts[-1] if plan.fits()), None)
        if fits is not None:
            return noted(fits, args, context)
    raise nothing_fits(args, hardware, context, contexts, attempts)


def candidate_plans(
    args: ModelArgs, hardware: Hardware, b: Budget, length: int, context: int, batch: int, host_table: bool
) -> list[Plan]:
    """What can be tried at a context of `length` tokens (of `context` asked), whose budget is
    `b`, in order of preference. `host_table`: an untied float embedding table on a GPU."""
    table_note = [TABLE_NOTE] if host_table else []
    on_device = "device" if length == context else "shorter-context"
    plans = [Plan(hardware, length, batch, b, on_device)]
    if host_table:
        plans.append(Plan(hardware, length, batch, b, on_device, table_on_host=True, notes=list(table_note)))
    if b.all_expert_bytes and hardware.host_bandwidth_bytes_s is not None:
        plans.append(
            Plan(
                hardware,
                length,
                batch,
                b,
                on_device,
                table_on_host=host_table,
                experts_on_host=True,
                notes=[*table_note, experts_note(b, hardware)],
            )
        )
    if hardware.host_link_bytes_s is not None:
        plans += [
            Plan(
                hardware,
                length,
                batch,
                b,
                "stream",
                streamed_layers=n,
                table_on_host=host_table,
                notes=list(table_note),
            )
            for n in range(1, args.n_layers + 1)
        ]
    return plans


def noted(plan: Plan, args: ModelArgs, context: int) -> Plan:
    """`plan`, its notes saying how to run it streamed and that its context is capped."""
    if plan.kind == "stream":
        plan.notes.append(
            f"{plan.streamed_layers} of {args.n_layers} decoder layers stay in pinned host memory and stream "
            f"in one layer ahead of use: run with --stream-layers {plan.streamed_layers}"
        )
    if plan.context < context:
        plan.notes.append(f"the context is capped at {plan.context} tokens (of {context} asked)")
    return plan


def nothing_fits(
    args: ModelArgs, hardware: Hardware, context: int, contexts: list[int], attempts: list[list[Plan]]
) -> SlimlmError:
    """The refusal when no plan fits at any of `contexts`: what was tried (`attempts`, the
    plans at each), and the budget at the context asked."""
    first, last = attempts[0], attempts[-1]
    on_device = [plan for plan in first if plan.kind == "device"][-1]
    tried = [f"everything on the device, {on_device.device_bytes() / GiB:.2f} GiB"]
    if first[-1].kind == "stream":
        host = (
            f" on the device and {first[-1].host_bytes() / GiB:.2f} GiB in host memory "
            f"(of {hardware.host_memory_bytes / GiB:.0f} GiB)"
            if hardware.host_memory_bytes
            else ""
        )
        tried.append(
            f"all {args.n_layers} layers streamed from host memory, "
            f"{first[-1].device_bytes() / GiB:.2f} GiB{host}"
        )
    if len(contexts) > 1:
        tried.append(f"a context of {contexts[-1]} tokens, at least {last[-1].device_bytes() / GiB:.2f} GiB")
    return SlimlmError(
        f"nothing fits {hardware.name} ({hardware.memory_bytes / GiB:.1f} GiB); tried {'; '.join(tried)}. "
        f"At {context} tokens:\n" + format_budget(first[0].budget, hardware)
    )


def experts_note(b: Budget, hardware: Hardware) -> str:
    """Why the routed experts are computed by the CPU where they lie rather than copied to the
    GPU as they are chosen: a decode step reads top_k of E experts per layer, and the CPU reads
    host memory faster than the host link moves it (60 against 12 GB/s on a laptop)."""
    read = b.all_expert_bytes * b.routed_fraction
    cpu_ms, link_ms = read / hardware.host_bandwidth_bytes_s * 1e3, read / hardware.host_link_bytes_s * 1e3
    line = (
        f"the routed experts ({b.all_expert_bytes / GiB:.2f} GiB) stay in host memory and run on the CPU: "
        f"a token reads {read / GiB:.2f} GiB of them, {cpu_ms:.1f} ms at "
        f"{hardware.host_bandwidth_bytes_s / 1e9:.0f} GB/s"
    )
    if cpu_ms <= link_ms:
        return f"{line}, against {link_ms:.1f} ms to copy them over the host link; run with --experts-on-host"
    return (
        f"{line}; copying them over the host link would take {link_ms:.1f} ms, which the decoder does not "
        "do yet; run with --experts-on-host"
    )


def format_budget(b: Budget, hardware: Hardware) -> str:
    rows = [
        ("decoder layers", sum(b.layer_bytes)),
        *([("  of which routed experts", b.all_expert_bytes)] if b.all_expert_bytes else []),
        ("LM head", b.head_bytes),
        ("embedding table", b.table_bytes),
        ("KV cache", b.kv_bytes),
        ("activations and logits", b.activation_bytes),
        ("runtime reserve", b.reserve_bytes),
        ("load transient (not with cache)", b.transit_bytes),
        ("total", b.total_bytes),
        (f"{hardware.name} memory", hardware.memory_bytes),
    ]
    return "\n".join(budget_line(name, value) for name, value in rows)


LABEL_WIDTH = 32  # the budget table's first column: its longest label fits


def budget_line(name: str, value: int) -> str:
    return f"  {name:<{LABEL_WIDTH}} {value / GiB:9.2f} GiB"


def format_plan(plan: Plan, model_name: str) -> str:
    b, hw = plan.budget, plan.hardware
    bound = plan.decode_tok_s_bound()
    device = "the GPU" if hw.device == "cuda" else "RAM"
    where = {
        "device": f"fits in {device}",
        "stream": f"{plan.streamed_layers} layers streamed from host memory",
        "shorter-context": f"fits in {device} with a shorter context",
    }[plan.kind]
    if plan.experts_on_host:
        where += ", routed experts in host memory"
    lines = [
        f"{model_name} on {hw.name}: {where}; context {plan.context}, batch {plan.batch}",
        format_budget(b, hw),
        budget_line("peak on the device", plan.device_bytes()),
        *([budget_line("in host memory", plan.host_bytes())] if plan.host_bytes() else []),
        f"  {'decode bound (batch 1)':<{LABEL_WIDTH}} {bound:9.1f} tokens/s at "
        f"{hw.bandwidth_bytes_s / 1e9:.0f} GB/s"
        + (f" and {hw.host_link_bytes_s / 1e9:.0f} GB/s host link" if plan.kind == "stream" else "")
        + (f" and {hw.host_bandwidth_bytes_s / 1e9:.0f} GB/s host memory" if plan.experts_on_host else ""),
        *[f"  note: {note}" for note in plan.notes],
    ]
    return "\n".join(lines)


def uniform_schemes(
    args: ModelArgs, scheme: Optional[QuantScheme], head: Optional[QuantScheme]
) -> dict[str, QuantScheme]:
    """Every decoder Linear in `scheme` (None: float) and the LM head in `head`."""
    schemes = {
        f"model.layers.{i}.{n}": scheme
        for i in range(args.n_layers)
        for group in linear_groups(args, i)
        for n in group
        if scheme is not None
    }
    if head is not None:
        schemes["lm_head"] = head
    return schemes
