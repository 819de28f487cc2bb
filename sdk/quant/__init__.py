"""Quantized checkpoints at load time: the config forms (`config`), tensor naming per convention
(`layout`), the checkpoint's packing worked out from its headers (`packing`), and packed
parameters made real in a built model (`materialize`). The formats' math and the PackedWeight
container are in kernels/packed.py; `check_requested` below checks `--quantization` against a
checkpoint. Checkpoint producers live with their users: ModelOpt-made test checkpoints in
sdk/parity/quantized_tiny.py, the benchmark's quantizer in sdk/bench/quantize.py."""

from dayzero.sdk.errors import CheckpointError

ALIASES = {"fp8": "fp8_block", "modelopt_fp4": "nvfp4"}  # vLLM's names for the same formats


def check_requested(formats: tuple[str, ...], requested: str | None) -> None:
    """`--quantization Q` names what the checkpoint holds (dayzero never quantizes at load)."""
    if requested is None:
        return
    want = ALIASES.get(requested, requested)
    if want == "none" and formats:
        raise CheckpointError(f"--quantization none, but the checkpoint is {', '.join(formats)}")
    if want != "none" and want not in formats:
        held = ", ".join(formats) or "not quantized"
        raise CheckpointError(
            f"--quantization {requested}: the checkpoint is {held} (dayzero serves a checkpoint's own "
            "format and does not quantize weights at load)"
        )
