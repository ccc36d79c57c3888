"""Read one MoE layer of a Kimi K3 checkpoint (safetensors, compressed-tensors MXFP4 experts):
only the experts a rank owns, plus the layer's dense weights. Names and shapes: docs/formats.md.

Layout on disk, per expert E under `language_model.model.layers.{layer}.block_sparse_moe.`:
`experts.{E}.w1.weight_packed` uint8 [I, L/2] (gate), `.w1.weight_scale` uint8 [I, L/32],
`w3` the same (up), `w2.weight_packed` uint8 [L, I/2] and `.w2.weight_scale` uint8 [L, I/32];
two E2M1 codes a byte (low nibble first), one E8M0 scale per 32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from dep_ep.checks import check_int
from dep_ep.config import MoeGeometry
from dep_ep.constants import SCALE_BLOCK
from dep_ep.experts.weights import ExpertWeights

INDEX_FILE = "model.safetensors.index.json"
SAFETENSORS_PIP = "pip install safetensors"


def layer_prefix(layer: int) -> str:
    return f"language_model.model.layers.{layer}.block_sparse_moe."


# The dense tensors of one MoE layer by checkpoint name, after the layer prefix (docs/formats.md).
GATE = "gate.weight"
BIAS = "gate.e_score_correction_bias"
DOWN = "routed_expert_down_proj.weight"
NORM = "routed_expert_norm.weight"
UP = "routed_expert_up_proj.weight"
SHARED_GATE = "shared_experts.gate_proj.weight"
SHARED_UP = "shared_experts.up_proj.weight"
SHARED_DOWN = "shared_experts.down_proj.weight"
DENSE_NAMES = (GATE, BIAS, DOWN, NORM, UP, SHARED_GATE, SHARED_UP, SHARED_DOWN)


def shared_intermediate(g: MoeGeometry) -> int:
    """S: the layer has one shared MLP of twice the routed intermediate (docs/formats.md)."""
    return 2 * g.intermediate


def dense_shapes(g: MoeGeometry) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Dense tensors of one MoE layer: name (after the prefix) -> (shape, dtype), in DENSE_NAMES'
    order."""
    S, bf16 = shared_intermediate(g), torch.bfloat16
    return {
        GATE: ((g.experts, g.hidden), bf16),
        BIAS: ((g.experts,), torch.float32),
        DOWN: ((g.latent, g.hidden), bf16),
        NORM: ((g.latent,), bf16),
        UP: ((g.hidden, g.latent), bf16),
        SHARED_GATE: ((S, g.hidden), bf16),
        SHARED_UP: ((S, g.hidden), bf16),
        SHARED_DOWN: ((g.hidden, S), bf16),
    }


def expert_shapes(g: MoeGeometry, expert: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """One expert's tensors: name (after the prefix) -> (shape, dtype)."""
    latent, inter, u8 = g.latent, g.intermediate, torch.uint8
    out = {}
    for w in ("w1", "w3"):
        out[f"experts.{expert}.{w}.weight_packed"] = ((inter, latent // 2), u8)
        out[f"experts.{expert}.{w}.weight_scale"] = ((inter, latent // SCALE_BLOCK), u8)
    out[f"experts.{expert}.w2.weight_packed"] = ((latent, inter // 2), u8)
    out[f"experts.{expert}.w2.weight_scale"] = ((latent, inter // SCALE_BLOCK), u8)
    return out


@dataclass
class MoeLayerWeights:
    """One rank's part of one MoE layer, in the layouts the backends and EpMoeLayer take.

    experts: the rank's experts as an ExpertWeights (experts/weights.py: w13 rows [w1 (gate);
    w3 (up)], s13, w2, s2 in the checkpoint layout, first_expert, num_experts = the geometry's E),
    which every backend takes as it is; dense: the layer's dense tensors by name (see
    dense_shapes).
    """

    experts: ExpertWeights
    dense: dict[str, torch.Tensor]


class CheckpointReader:
    """Tensors of a safetensors checkpoint folder, by name, read lazily (only what is asked).

    The folder holds `model.safetensors.index.json` (weight_map: name -> file) or a single
    `*.safetensors` file.
    """

    def __init__(self, folder: str | Path):
        try:
            from safetensors import safe_open
        except ImportError as err:
            raise ImportError(f"reading checkpoints needs safetensors: {SAFETENSORS_PIP}") from err
        self._safe_open = safe_open
        self.folder = Path(folder)
        index = self.folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                self.files = {name: self.folder / file for name, file in weight_map.items()}
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ValueError(
                    f"CheckpointReader: {index} is not a safetensors index (a JSON object whose"
                    f' "weight_map" maps tensor names to files): {type(err).__name__}: {err}'
                ) from err
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if len(files) != 1:
                raise FileNotFoundError(
                    f"CheckpointReader: {self.folder} has no {INDEX_FILE} and"
                    f" {len(files)} .safetensors files (need the index or exactly one file)"
                )
            with safe_open(files[0], framework="pt") as f:
                self.files = {name: files[0] for name in f.keys()}
        self._open: dict[Path, object] = {}

    def _handle(self, name: str):
        """The open file that holds tensor `name`, checked to hold it: KeyError naming the
        tensor when the index lacks it, or its file is missing, damaged or lacks it."""
        path = self.files.get(name)
        if path is None:
            raise KeyError(f"checkpoint {self.folder}: tensor {name} is missing")
        try:
            if path not in self._open:
                self._open[path] = self._safe_open(path, framework="pt").__enter__()
            handle = self._open[path]
            if name not in handle.keys():
                raise KeyError(f"{path.name} holds no tensor {name}")
        except Exception as err:
            raise self._unreadable(name, err) from err
        return handle

    def _unreadable(self, name: str, err: Exception) -> KeyError:
        """The KeyError for tensor `name` that its file could not give (`err` says why)."""
        return KeyError(
            f"checkpoint {self.folder}: tensor {name} not readable from"
            f" {self.files[name].name}: {type(err).__name__}: {err}"
        )

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor `name`, checked against `shape` and `dtype`; errors name the tensor."""
        handle = self._handle(name)
        try:
            t = handle.get_tensor(name)
        except Exception as err:  # a damaged file whose header still reads
            raise self._unreadable(name, err) from err
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(
                f"checkpoint {self.folder}: tensor {name} is {t.dtype} {tuple(t.shape)};"
                f" expected {dtype} {shape}"
            )
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` from its file's header (no data read); errors as get's."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def close(self) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()


def load_moe_layer(
    folder: str | Path,
    layer: int,
    geometry: MoeGeometry,
    *,
    first_expert: int,
    num_local_experts: int,
    device: torch.device | str = "cpu",
    dense: bool = True,
) -> MoeLayerWeights:
    """Read MoE layer `layer`: experts [first_expert, first_expert + num_local_experts) of the
    geometry's E (an ExpertWeights) and (when `dense`) the layer's dense weights, onto `device`.
    Blocks the host; reads only those tensors. Raises KeyError naming a missing tensor,
    ValueError naming a tensor of the wrong shape/dtype, a file or index that cannot be read,
    or a bad argument (TypeError for its type)."""
    fn = "load_moe_layer"
    if not isinstance(geometry, MoeGeometry):
        raise TypeError(f"{fn}: geometry is {type(geometry).__name__}; expected a MoeGeometry")
    layer = check_int(fn, "layer", layer)
    if layer < 0:
        raise ValueError(f"{fn}: layer={layer}; expected an int >= 0")
    first_expert = check_int(fn, "first_expert", first_expert)
    num_local_experts = check_int(fn, "num_local_experts", num_local_experts)
    if num_local_experts < 1:
        raise ValueError(f"{fn}: num_local_experts={num_local_experts}; expected an int >= 1")
    if first_expert < 0 or first_expert + num_local_experts > geometry.experts:
        raise ValueError(
            f"{fn}: experts {first_expert}..{first_expert + num_local_experts - 1}"
            f" outside 0..{geometry.experts - 1}"
        )
    prefix = layer_prefix(layer)
    reader = CheckpointReader(folder)
    try:
        # The geometry's E against the gate's rows ([E, H]), from its header (no data read):
        # with dense=False the gate is not read, and a geometry of another E loaded silently.
        # A folder without the gate (one rank's experts alone) is not checked.
        gate = prefix + GATE
        if gate in reader.files:
            rows = reader.shape(gate)[0]
            if rows != geometry.experts:
                raise ValueError(
                    f"{fn}: checkpoint {reader.folder}: {gate} has {rows} rows (the model's"
                    f" experts); the geometry {geometry.name} has {geometry.experts}"
                )
        w13, s13, w2, s2 = [], [], [], []
        for e in range(first_expert, first_expert + num_local_experts):
            t = {n: reader.get(prefix + n, *spec) for n, spec in expert_shapes(geometry, e).items()}
            base = f"experts.{e}."
            w13.append(torch.cat([t[base + "w1.weight_packed"], t[base + "w3.weight_packed"]]))
            s13.append(torch.cat([t[base + "w1.weight_scale"], t[base + "w3.weight_scale"]]))
            w2.append(t[base + "w2.weight_packed"])
            s2.append(t[base + "w2.weight_scale"])
        dense_weights = {}
        if dense:
            dense_weights = {
                n: reader.get(prefix + n, *spec).to(device)
                for n, spec in dense_shapes(geometry).items()
            }
    finally:
        reader.close()
    stack = [torch.stack(ts).to(device) for ts in (w13, s13, w2, s2)]
    experts = ExpertWeights(*stack, first_expert=first_expert, num_experts=geometry.experts)
    return MoeLayerWeights(experts, dense=dense_weights)
