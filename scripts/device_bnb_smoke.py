"""Smoke test of 4-bit and 8-bit loading (bitsandbytes, CUDA only) for scripts/device_check.sh.

For each quantization: load the embedded model through Engine.load, then decode two HumanEval
prompts greedily with vanilla and with SDSAT (k=3, two-step) and say whether the outputs match.
One JSON object per line on stdout; a load that fails is reported as such, not raised.
"""

from __future__ import annotations

import argparse
import json
import time


def smoke(quantization: str, device: str, max_new_tokens: int) -> dict:
    import torch

    from sdsat import DecodeConfig, Engine, LoadConfig
    from sdsat.bench.prompts import humaneval_prompts
    from sdsat.records import collect

    row: dict = {"quantization": quantization}
    start = time.perf_counter()
    try:
        engine = Engine.load(LoadConfig(device=device, quantization=quantization))
    except (ValueError, ImportError, RuntimeError) as err:
        return row | {"loaded": False, "error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
    row |= {"loaded": True, "load_seconds": round(time.perf_counter() - start, 1),
            "footprint_mb": round(engine.model.get_memory_footprint() / 2**20, 1),
            "linear_types": sorted({type(m).__name__ for m in engine.model.modules() if "Linear" in type(m).__name__})}
    runs = []
    for prompt in humaneval_prompts("0-1"):
        ids = engine.encode(prompt.text)
        out = {}
        for name, config in (("vanilla", DecodeConfig(method="vanilla", max_new_tokens=max_new_tokens)),
                             ("sdsat", DecodeConfig(method="sdsat", k=3, max_new_tokens=max_new_tokens))):
            try:
                collect(engine.stream(ids, DecodeConfig(method=config.method, k=config.k, max_new_tokens=4)))
                result = collect(engine.stream(ids, config))
            except (RuntimeError, ValueError, TypeError) as err:
                out[name] = {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}
                continue
            if device == "cuda":
                torch.cuda.synchronize()
            out[name] = {"tokens": len(result.token_ids), "tokens_per_second": round(result.tokens_per_second, 1),
                         "tokens_per_forward_pass": round(result.tokens_per_forward_pass, 2),
                         "ids": result.token_ids}
        same = "error" not in out["vanilla"] and "error" not in out["sdsat"] and \
            out["vanilla"]["ids"] == out["sdsat"]["ids"]
        for value in out.values():
            value.pop("ids", None)
        runs.append({"prompt": prompt.name, "identical": same, **out})
    return row | {"runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    for quantization in ("4bit", "8bit"):
        print(json.dumps(smoke(quantization, args.device, args.max_new_tokens)), flush=True)


if __name__ == "__main__":
    main()
