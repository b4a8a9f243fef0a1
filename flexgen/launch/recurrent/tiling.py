"""How a fused recurrent call's [B, H] neurons are cut into programs (`Tiling`), the user's say in it
(`RecurrentConfig`) and the rules of thumb behind the choices (H100 sweeps, docs/perf/NOTES.md)."""
import functools
import os
from typing import NamedTuple, Optional

import torch

from ..config import HALF_DTYPES, compute_dtype
from ..triton_path import cuda_index, current_stream, on_device_of, sm_count


DEFAULT_MAX_TILE = {"16-bit": 16 * 1024, "other": 16 * 512}  # values of each state per program
# The tiling's rules of thumb (H100 sweeps, docs/perf/NOTES.md): 16-bit products take Hopper's warp-group MMA
# (64 rows) from WIDE_BATCH rows on; a program's slice keeps at least `_min_slice` neurons.
WIDE_BATCH = 128
# A program that keeps its slice of the weight (`RecurrentConfig.stationary`): by default float32 batches of at most
# STATIONARY_BATCH rows (16-bit: STATIONARY_HALF_BATCH) of layers of at least STATIONARY_LEAST_HIDDEN neurons whose
# programs all run at once (float32 batches of at most STATIONARY_TWO_WAVES_BATCH rows: in at most two waves); tiles
# of at most STATIONARY_ROWS rows; at most STATIONARY_BYTES of the weight a program (128 registers a thread of its 4
# warps); the [BLOCK_B, BLOCK, H] product summed at once up to STATIONARY_PRODUCT_BYTES, a batch row at a time above
# (H100 sweeps of B 1-32, H 256-2048, fp32 and bf16: docs/perf/NOTES.md, "Recurrent layers").
STATIONARY_BATCH = 16
STATIONARY_TWO_WAVES_BATCH = 12  # fp32, H 2048: B 9-12 0.72-0.76x the sliced tiling's training time, B 16 1.03x
STATIONARY_HALF_BATCH = 8
STATIONARY_ROWS = 8
STATIONARY_LEAST_HIDDEN = 256  # the narrowest layer measured; narrower ones take few programs anyway
STATIONARY_BYTES = 64 * 1024
STATIONARY_PRODUCT_BYTES = 256 * 1024
STATIONARY_LEAST_SLICE = 4


class Tiling(NamedTuple):
    """How one call's [B, H] neurons are cut into programs: `block_b` batch rows by `block` hidden neurons each,
    `split` programs per row tile (one slice of `block` neurons each, the whole layer together), and the recurrent
    product in slices of `block_k` of the neurons it sums over, `stages` slices in flight. `stationary`: each
    program loads its slice of the weight once and keeps it in registers for every step (`block_k` then covers all
    neurons), and sums the product on CUDA cores, a batch row at a time where `row_by_row`."""

    block_b: int
    block: int
    split: int
    block_k: int
    stages: int = 3
    stationary: bool = False
    row_by_row: bool = False

    def rows(self, batch):
        return -(-batch // self.block_b)

    def grid(self, batch):
        return (self.rows(batch) * self.split,)

    def sync(self, batch, device):
        """The counters the programs of a call synchronise on (see `step_barrier` in templates/recurrent_macros.j2),
        zeros: a ticket counter, one arrival counter per row tile and an exit counter; one int32 otherwise unused
        without a split."""
        if self.split == 1:
            return torch.empty(1, dtype=torch.int32, device=device)
        return torch.zeros(self.n_counters(batch), dtype=torch.int32, device=device)

    def n_counters(self, batch):
        return 2 + self.rows(batch) if self.split > 1 else 1

    def kept_sync(self, batch, device):
        """`sync`'s counters for an eager launch: kept per device and stream and reused, since the kernels leave
        them at zero (templates/static/release_counters.py), which saves a fill launch per call. Launches on
        one stream run one after another, so none shares them with another that runs; while a CUDA graph is
        captured each launch gets its own, zeroed in the graph."""
        if device.type != "cuda" or _capturing(device):
            return self.sync(batch, device)
        index = cuda_index(device)
        key = (index, current_stream(index))
        counters = _KEPT_COUNTERS.get(key)
        if counters is None or counters.numel() < self.n_counters(batch):
            counters = _KEPT_COUNTERS[key] = torch.zeros(max(self.n_counters(batch), 64), dtype=torch.int32,
                                                         device=device)
        return counters


_KEPT_COUNTERS = {}  # (CUDA device index, stream) -> int32 counters, zero between launches (`Tiling.kept_sync`)


def _capturing(device):
    """Whether `device`'s current stream is capturing a CUDA graph (`device` made current to ask, if it is not)."""
    with on_device_of(device):
        return torch.cuda.is_current_stream_capturing()


class RecurrentConfig(NamedTuple):
    """How the fused recurrent kernels are launched; None for the choice `tiling` makes per call.

    `block_b`: batch rows per program (16, the smallest tile `tl.dot` takes; 64 for 16-bit batches of at least
    `WIDE_BATCH`); `block_k`: neurons per slice of the recurrent product's sum (the weight's slice, `block_k` x
    `block`, goes through shared memory, `num_stages` slices in flight: None for `_chosen_stages`); `max_tile`:
    the most neurons one program keeps, `block_b` x `block` (every state and value of them stays in registers;
    `DEFAULT_MAX_TILE` by I/O dtype: at 16 x 1024 in fp32 an H100 run was slower than stepping: docs/perf/NOTES.md);
    `split`: programs per row tile, each with a slice of the hidden neurons; `max_hidden`: the largest layer that
    runs fused (None: no limit); `num_warps`: None for about 16 values of a tile per thread (4 to 16 warps);
    `stationary`: whether each program keeps its slice of the weight in registers for all steps and sums the product on
    CUDA cores, with no `tl.dot` tile of 16 rows to pad: None for float32 batches of at most `STATIONARY_BATCH` rows
    and 16-bit ones of at most `STATIONARY_HALF_BATCH` whose programs fit the GPU at once (float32 ones of at most
    `STATIONARY_TWO_WAVES_BATCH` rows in two waves), where none of the sliced tiling's settings, `block_b`,
    `block_k`, `split`, `num_stages`, `max_tile`, is given; True to ask for it (undelayed layers; `split` may be
    set), False never.
    """

    block_b: Optional[int] = None
    block_k: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    max_hidden: Optional[int] = None
    max_tile: Optional[int] = None
    split: Optional[int] = None
    stationary: Optional[bool] = None

    def tile_limit(self, dtype):
        if self.max_tile is not None:
            return self.max_tile
        return DEFAULT_MAX_TILE[_width(dtype)]

    def tiling(self, batch, hidden, dtype, programs, plain=True):
        """The `Tiling` of a call, or a string saying why none fits. `programs`: the GPU's SM count, None where
        programs run one after another (the interpreter: one program per row tile, whatever its size); `plain`:
        the layer has no delays (the only kernels that can keep the weight stationary)."""
        full = max(16, 1 << (hidden - 1).bit_length())
        for name in ("block_b", "block_k"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                return f"RecurrentConfig.{name}={value} must be a power of two of at least 16 (tl.dot's smallest tile)"
        if self.num_stages is not None and self.num_stages < 1:
            return f"RecurrentConfig.num_stages={self.num_stages} must be at least 1 (slices of the weight in flight)"
        if self.max_hidden is not None and hidden > self.max_hidden:
            return f"hidden={hidden} is above RecurrentConfig.max_hidden={self.max_hidden}"
        if self.stationary or (self.stationary is None
                               and self._stationary_by_default(batch, hidden, dtype, programs, plain)):
            stationary = self._stationary_tiling(batch, full, dtype, programs, plain)
            if self.stationary or self._soon_enough(stationary, batch, dtype, programs):
                return stationary
        if programs is None:
            if self.split not in (None, 1):
                return _split_needs_a_gpu(self.split)
            return Tiling(self.block_b or 16, full, 1, min(self.block_k or 32, full), self.num_stages or 3)
        block_b = self.block_b or (64 if dtype in HALF_DTYPES and batch >= WIDE_BATCH else 16)
        least = max(1, block_b * full // self.tile_limit(dtype))
        split = self.split or self._chosen_split(block_b, least, full, -(-batch // block_b), dtype, programs)
        if split < least or split & (split - 1) or full // split < 16:
            return (f"split={split} must be a power of two from {least} (tiles of at most {self.tile_limit(dtype)} "
                    f"neurons, RecurrentConfig.max_tile) to {full // 16} (16 neurons a program)")
        if split > programs:
            return (f"hidden={hidden} needs {split} programs in step with each other, and this GPU holds "
                    f"{programs} at once")
        block = full // split
        block_k = self.block_k or _chosen_block_k(block, block_b, full, dtype)
        stages = self.num_stages or _chosen_stages(block_b, block, block_k, full, dtype)
        return Tiling(block_b, block, split, block_k, stages)

    def _stationary_by_default(self, batch, hidden, dtype, programs, plain):
        most = STATIONARY_HALF_BATCH if dtype in HALF_DTYPES else STATIONARY_BATCH if dtype == torch.float32 else 0
        return (plain and programs is not None and batch <= most and hidden >= STATIONARY_LEAST_HIDDEN
                and all(v is None for v in (self.block_b, self.block_k, self.split, self.num_stages, self.max_tile)))

    def _soon_enough(self, tiling, batch, dtype, programs):
        """Whether every program of `tiling` runs at once (later row tiles would wait for SMs), 16-bit ones one per
        SM (two per SM were slower than the weight in slices, where fp32's were faster); float32 batches of at most
        STATIONARY_TWO_WAVES_BATCH rows may take two waves."""
        if isinstance(tiling, str):
            return False
        waves = 2 if dtype == torch.float32 and batch <= STATIONARY_TWO_WAVES_BATCH else 1
        return tiling.rows(batch) * tiling.split <= waves * self.at_once(tiling, dtype, programs)

    def _stationary_tiling(self, batch, full, dtype, programs, plain):
        """The `Tiling` whose programs keep their slice of the weight, or a string saying why none fits."""
        if not plain:
            return "RecurrentConfig.stationary: only the kernels of layers without delays keep the weight"
        if self.block_b is not None or self.block_k is not None:
            return "RecurrentConfig.stationary chooses its own block_b and block_k (the batch's rows, every neuron)"
        if self.split is not None and (self.split < 1 or self.split & (self.split - 1) or self.split > full):
            return f"split={self.split} must be a power of two from 1 to {full} (hidden={full} in slices)"
        width = compute_dtype(dtype).itemsize  # the weight is kept in the compute dtype
        block_b = min(STATIONARY_ROWS, 1 << (batch - 1).bit_length())
        if programs is None or self.split is not None:
            block = full // (self.split or 1)
        else:  # the narrowest slices that give each SM one program, no wider than STATIONARY_BYTES of the weight allow
            narrowest = max(STATIONARY_LEAST_SLICE, 1 << (-(-full // programs) - 1).bit_length())
            block = min(narrowest, STATIONARY_BYTES // width // full)
        if programs is not None and (block < 1 or block * full * width > STATIONARY_BYTES):
            return (f"RecurrentConfig.stationary: a program keeps at most {STATIONARY_BYTES // 1024} KiB of the "
                    f"weight, and hidden={full} gives {full * width // 1024} KiB a neuron")
        row_by_row = block_b == 1 or block_b * block * full * width > STATIONARY_PRODUCT_BYTES
        tiling = Tiling(block_b, block, full // block, full, 1, True, row_by_row)
        if programs is None and tiling.split > 1:
            return _split_needs_a_gpu(tiling.split)
        if programs is not None and tiling.split > self.resident(tiling, programs):
            return (f"RecurrentConfig.stationary: hidden={full} in slices of {block} takes {tiling.split} programs in "
                    f"step with each other, and this GPU holds {self.resident(tiling, programs)} at once")
        return tiling

    def _chosen_split(self, block_b, least, full, rows, dtype, programs):
        """The fewest slices that fit a tile, doubled while the programs keep at least `_min_slice` neurons each
        and fit the GPU at once: more programs share each step's loads of the weight. A row tile's slices must run
        at once; 16-bit programs stay within one per SM (two per SM, sharing its loads, were slower), fp32 ones
        within `resident`."""
        split = least
        while full // (split * 2) >= _min_slice(block_b, dtype) and split * 2 <= programs:
            halved = Tiling(block_b, full // (split * 2), split * 2, 16)
            if rows * halved.split > self.at_once(halved, dtype, programs):
                break
            split *= 2
        return split

    def at_once(self, tiling, dtype, programs):
        """How many programs of `tiling` the rules let run at once: 16-bit ones one per SM, others `resident`."""
        return programs if dtype in HALF_DTYPES else self.resident(tiling, programs)

    def resident(self, tiling, programs):
        """How many programs of `tiling` a GPU of `programs` SMs holds at once: two per SM where a program has four
        warps (their 255 registers a thread at most fill half an SM's register file), else one."""
        return programs * (2 if self.warps(tiling) <= 4 else 1)

    def warps(self, tiling):
        if self.num_warps is not None:
            return self.num_warps
        return max(4, min(16, tiling.block_b * tiling.block // (32 * 16)))

    def constexprs(self, tiling):
        return {"BLOCK_B": tiling.block_b, "BLOCK": tiling.block, "BLOCK_K": tiling.block_k, "SPLIT": tiling.split,
                "STATIONARY_WEIGHT": tiling.stationary, "ROW_BY_ROW": tiling.row_by_row}


def _split_needs_a_gpu(split):
    """Why slices in step cannot run on the interpreter: a row tile's slices wait for each other every step."""
    return f"split={split} needs a GPU: the interpreter runs one program after another"


def _width(dtype):
    return "16-bit" if dtype in HALF_DTYPES else "other"


def _min_slice(block_b, dtype):
    """The fewest neurons a program's slice keeps: 16 for 16-bit tiles of 64 rows, 32 otherwise (16-bit tiles of
    16 rows by 16 neurons, and fp32 slices of 16, were slower than the fewer, wider programs: docs/perf/NOTES.md)."""
    return 16 if dtype in HALF_DTYPES and block_b >= 64 else 32


def _chosen_block_k(block, block_b, full, dtype):
    """Slices of the product's sum over the `full` (padded) hidden neurons. In fp32 (three TF32 passes, operands
    held three times): 128 for slices of up to 32 neurons, 64 for 64, else 32. In 16-bit: 128 for slices of up to
    64 neurons and tiles of 64 rows by 128, else 64, fewer where the weight's slice would pass 64 KiB (two in flight
    must fit shared memory). Fewer slices mean fewer waits on loads each step (H100 sweeps, docs/perf/NOTES.md)."""
    if dtype in HALF_DTYPES:
        return min(full, 128 if block <= 64 or (block_b >= 64 and block <= 128) else 64, 32768 // block)
    return min(full, 128 if block <= 32 else 64 if block <= 64 else 32)


def _chosen_stages(block_b, block, block_k, full, dtype):
    """Slices of the weight in flight: 4 for 16-bit tiles of 64 rows by up to 32 neurons whose sum takes at least 8
    slices (0.94-0.98x the time of 3 at H 1024-2048 on an H100; no better, or slower, for smaller sums, wider slices
    and 16-row tiles: docs/perf/NOTES.md), else 3 (0.57-1.19x the time of 2: docs/perf/NOTES.md)."""
    if dtype in HALF_DTYPES and block_b >= 64 and block <= 32 and full // block_k >= 8:
        return 4
    return 3


def resident_programs(device):
    """How many programs of a fused recurrent kernel can run at once on `device` (one per SM it may use), or None
    for CPU tensors (the interpreter)."""
    if device.type != "cuda":
        return None
    sms = sm_count(cuda_index(device))
    return usable_sms(sms, os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"))


def usable_sms(sms, mps_percentage):
    """The SMs a process may use: all `sms`, or under CUDA MPS the share its CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
    allows (the device still reports all of them; slices that wait for each other must fit the share, or they
    would wait forever)."""
    try:
        share = float(mps_percentage) if mps_percentage else 100.0
    except ValueError:
        return sms
    return max(1, min(sms, int(sms * share / 100.0)))


@functools.lru_cache(maxsize=256)
def cached_tiling(config, batch, hidden, dtype, programs, plain=True):
    """`config.tiling(...)`, made once per call shape: the layer and both kernels ask for it every call."""
    return config.tiling(batch, hidden, dtype, programs, plain)


def call_tiling(config, batch, hidden, dtype, device, plain=True):
    """The `Tiling` of a fused call; a ValueError where none fits (the layer checks before it launches)."""
    tiling = cached_tiling(config, batch, hidden, dtype, resident_programs(device), plain)
    if isinstance(tiling, str):
        raise ValueError(f"the fused recurrent kernels cannot run this call: {tiling}")
    return tiling


DEFAULT_RECURRENT = RecurrentConfig()


def dot_precision(dtype):
    """The recurrent product's `input_precision`. Operands are in the I/O dtype: fp16 and bf16 go to the tensor
    cores as they are (exact for spikes); fp32 takes 3xTF32 (about fp32's accuracy on tensor cores), or TF32 where
    torch allows it for its own matmuls; fp64 is exact."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "tf32x3"
    return "ieee"


_STATIONARY_CODES = (None, True, False)  # RecurrentConfig.stationary as an int: its index


def config_values(config):
    """A `RecurrentConfig`'s launch settings as the custom ops take them (ints; 0 for None)."""
    return [config.block_b or 0, config.block_k or 0, config.num_warps or 0, config.num_stages or 0,
            config.max_tile or 0, config.split or 0, _STATIONARY_CODES.index(config.stationary)]


def config_of(values):
    block_b, block_k, num_warps, num_stages, max_tile, split, stationary = values
    return RecurrentConfig(block_b or None, block_k or None, num_warps or None, num_stages or None, None,
                           max_tile or None, split or None, _STATIONARY_CODES[stationary])
