"""The benchmark: SDSAT against vanilla decoding, `model.generate` and prompt lookup decoding.

Modules, in the order a run uses them:
  prompts    prompt sources: HumanEval and JSON-lines files
  methods    the decoders raced, and a runner that times one generation and counts forward passes
  runner     the loop (warm-up, interleaving, repeats), HumanEval pass@1 scoring, machine info
  humaneval  the pass@1 harness: completions run in a subprocess with a timeout
  stats      the summary metrics of a results payload
  report     the results payload and its JSON file
  table      the markdown table
  figures    plotly figures (HTML, PNG)
Run it with `python -m sdsat.bench --help`.
"""
