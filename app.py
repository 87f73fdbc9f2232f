"""The SDSAT web demo: vanilla decoding races SDSAT on your prompt, with colour-coded tokens,
a step explorer and latency plots. Run `python app.py` (or `make demo`); a Hugging Face Space runs
this file as it is.

This file only wires components to `sdsat.ui`; operator limits come from environment variables
(see `sdsat/ui/settings.py` and the README's "Limits and safety").
"""

from __future__ import annotations

import logging

import spaces  # noqa: F401  (first: on ZeroGPU it must patch torch before anything starts CUDA)
import gradio as gr

from sdsat import ASSETS
from sdsat.checkpoints import known_checkpoint
from sdsat.decoding import MAX_TREE_CANDIDATES, DecodeConfig
from sdsat.ui.benchmark import load_suites
from sdsat.ui.events import close_direct_routes
from sdsat.ui.handlers import RACE_OUTPUTS, Page
from sdsat.ui.render import legend_html, waiting_html
from sdsat.ui.settings import MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K, Limits
from sdsat.ui.style import LAUNCH
from sdsat.ui.zerogpu import on_zero_gpu

DIAGRAM = ASSETS / "sdsat_diagram.svg"
HOW_IT_WORKS = ASSETS / "how_it_works.md"
MAX_BENCH_PLOTS = 12  # plotly figures saved as JSON (the shipped suites show PNGs); more are not drawn

limits = Limits.from_env()
page = Page(limits)  # the engine cache inside is the only object shared between visitors

CODE_EXAMPLES = {
    "fibonacci (code)": ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', False],
    "palindrome (code)": ["def is_palindrome(s: str) -> bool:\n", False],
    "softmax (code)": ["import numpy as np\n\n\ndef softmax(x):\n", False],
    "web page (HTML)": ["<!-- a tiny web page -->\n<html>\n<head>\n  <title>", False],
}
CHAT_EXAMPLES = {
    "explain (chat)": ["Explain speculative decoding to a student in three sentences.", True],
    "prime check (chat)": ["Write a Python function that checks whether a number is prime.", True],
}
EXAMPLES = list(CODE_EXAMPLES.values()) + list(CHAT_EXAMPLES.values())
_checkpoint = known_checkpoint(limits.models[0])
CHAT_SHOWN = _checkpoint is None or _checkpoint.chat  # until the model has loaded and says for itself


# Read once at start: the results do not change while the app runs, and reading them per page load
# (145 ms of file reads and parsing) would let any client spend the server's CPU for free.
BENCH = load_suites()


with gr.Blocks(title="SDSAT: speculative decoding with semantic adaptive tokens") as demo:
    gr.Markdown(
        "# ⚡ SDSAT — speculative decoding with semantic adaptive tokens\n"
        "The model drafts several tokens at once with *adaptive tokens* (SATs), then checks them in one forward "
        "pass. Race it against ordinary decoding on your own prompt — both run for real on this machine, "
        "[paper: arXiv 2403.18647](https://arxiv.org/abs/2403.18647).",
        elem_id="title")
    # this visitor's last race (RaceRecord), dropped after the operator's time-to-live
    record = gr.State(None, time_to_live=limits.state_ttl_s)

    with gr.Tab("Race"):
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=330):
                prompt = gr.Textbox(label="Prompt", lines=7, max_lines=16, value=EXAMPLES[0][0],
                                    placeholder="Code to complete, or a question (tick 'chat')")
                chat = gr.Checkbox(label="Chat: wrap the prompt in the model's chat template", value=False,
                                   visible=CHAT_SHOWN)
                with gr.Row():
                    run_btn = gr.Button("Run the race", variant="primary", scale=2)
                    stop_btn = gr.Button("Stop", variant="stop", scale=1)
                gr.Examples(list(CODE_EXAMPLES.values()), inputs=[prompt, chat], api_visibility="private",
                            label="Examples: code completion, as in the paper", example_labels=list(CODE_EXAMPLES))
                with gr.Column(visible=CHAT_SHOWN) as chat_examples:
                    gr.Examples(list(CHAT_EXAMPLES.values()), inputs=[prompt, chat], label="Examples: chat",
                                example_labels=list(CHAT_EXAMPLES), api_visibility="private")
                with gr.Accordion("Settings", open=True):
                    mode = gr.Radio(["greedy", "sampling"], value="greedy", label="Decoding",
                                    info="Greedy output must be identical to vanilla; the page checks it.")
                    k = gr.Slider(1, 8, value=DecodeConfig.k, step=1, label="k: adaptive tokens (drafts) per step")
                    max_new = gr.Slider(1, limits.max_new_tokens, value=min(64, limits.max_new_tokens), step=1,
                                        label="Max new tokens", elem_id="max-new")
                    lookup = gr.Slider(0, 16, value=0, step=1, label="Prompt lookup: copied tokens to verify (0 = off)",
                                       info="Not in the paper: where the last tokens occurred before, SDSAT verifies "
                                            "up to this many tokens copied from there instead of SAT drafts. "
                                            "Fast on code, which repeats its names; outputs stay identical.")
                    tree = gr.Slider(0, MAX_TREE_CANDIDATES, value=0, step=1, elem_id="tree",
                                     label="Draft tree: runner-up candidates to verify too (0 = off)",
                                     info="Not in the paper, greedy only: the verify pass also checks the SATs' "
                                          "second choices, which on a CPU ride along at almost no cost.")
                    with gr.Group(visible=False) as sampling_box:
                        temperature = gr.Slider(0.05, MAX_TEMPERATURE, value=0.8, step=0.05, label="Temperature")
                        top_p = gr.Slider(0.05, 1.0, value=0.95, step=0.01, label="Top-p")
                        top_k = gr.Slider(0, MAX_TOP_K, value=50, step=1, label="Top-k (0 = off)")
                        seed = gr.Number(value=0, precision=0, minimum=0, maximum=MAX_SEED, label="Seed")
                    model = gr.Dropdown(limits.models, value=limits.models[0], label="Model",
                                        info="Only models the operator has listed.", interactive=len(limits.models) > 1)
                    show_rejected = gr.Checkbox(label="Show rejected drafts (struck through)", value=False)
            with gr.Column(scale=2):
                headline = gr.HTML('<div class="check info">Press <b>Run the race</b>. Vanilla decoding runs first, '
                                   'then SDSAT — one after the other, never at the same time, because on a 2-core '
                                   'machine they would slow each other down. <b>Replay</b> then shows both on one clock.</div>',
                                   js_on_load=None, label="headline")
                with gr.Row(equal_height=False):
                    with gr.Column(min_width=280):
                        gr.HTML('<div class="pane-title">Vanilla decoding <span class="muted">· one token per forward pass</span></div>', js_on_load=None)
                        vanilla_out = gr.HTML(waiting_html("Vanilla output appears here."), js_on_load=None, elem_id="vanilla-out",
                                              label="vanilla_output")
                    with gr.Column(min_width=280):
                        gr.HTML('<div class="pane-title">SDSAT <span class="muted">· draft with SATs, verify in one pass</span></div>', js_on_load=None)
                        sdsat_out = gr.HTML(waiting_html("SDSAT output appears here, coloured by where each token came from."),
                                            js_on_load=None, elem_id="sdsat-out", label="sdsat_output")
                gr.HTML(legend_html(), js_on_load=None)
                replay_btn = gr.Button("▶ Replay both on one clock, at the measured speed", size="sm")

        gr.Markdown("### Step explorer — one SDSAT iteration: draft, then verify")
        with gr.Row():
            prev_btn = gr.Button("◀ previous", size="sm", scale=0, min_width=110)
            iteration = gr.Slider(1, 2, value=1, step=1, label="Iteration", interactive=False, scale=4)
            next_btn = gr.Button("next ▶", size="sm", scale=0, min_width=110)
        explorer_out = gr.HTML(page.explore(None, 1), js_on_load=None, elem_id="explorer", label="step_explorer")

        gr.Markdown("### Plots")
        with gr.Row():
            race_plot = gr.Plot(label="Latency race", show_label=False, elem_id="race-plot")
            accepted_plot = gr.Plot(label="Tokens per iteration", show_label=False)
        with gr.Row():
            position_plot = gr.Plot(label="Acceptance by draft position", show_label=False)
            pass_plot = gr.Plot(label="Time per forward pass", show_label=False)
        with gr.Accordion("Metrics, defined", open=False):
            gr.Markdown(
                "- **Tokens/s**: new tokens ÷ wall time of the request (prompt reading included), measured inside the decoder.\n"
                "- **Speed-up**: SDSAT tokens/s ÷ vanilla tokens/s, same prompt, same run, same machine.\n"
                "- **Tokens per iteration** (mean accepted length): new tokens per SDSAT iteration, *counting* the "
                "step-1 token t and the bonus token — so it is 2 + accepted drafts, and 2.0 means no draft was accepted "
                "(1 + accepted copies when prompt lookup's copies were verified without a draft pass).\n"
                "- **Forward passes per token**: forward passes of the model ÷ new tokens (vanilla: 1.0). "
                "Each SDSAT iteration costs 2 passes (1 when prompt lookup's copies are verified without a draft pass).\n"
                "- **Acceptance rate per draft position**: of the iterations that drafted position *i*, the share in which draft *i* was accepted.\n"
                "- **Timing honesty**: the two decoders run one after the other in a worker thread that does nothing "
                "else; the page updates in between never fall inside a decoder's clock.")
        with gr.Accordion("Run data (JSON, also returned by the API)", open=False):
            run_data = gr.JSON(label="Run data")

    with gr.Tab("How it works"):
        gr.HTML(f'<div class="diagram">{DIAGRAM.read_text()}</div>' if DIAGRAM.is_file() else "", js_on_load=None)
        gr.Markdown(HOW_IT_WORKS.read_text() if HOW_IT_WORKS.is_file() else "", elem_classes="howto")

    with gr.Tab("Benchmark"):
        gr.Markdown("Results of the project's benchmark, read from `assets/bench/` (not recomputed here). "
                    "Every figure states its hardware and settings.")
        gr.HTML(BENCH.html + BENCH.frames, js_on_load=None)
        gr.Gallery(BENCH.images or None, label="Figures", visible=bool(BENCH.images), columns=1, height="auto",
                   object_fit="contain")
        for figure in BENCH.figures[:MAX_BENCH_PLOTS]:
            gr.Plot(figure)
        gr.File(BENCH.downloads or None, label="Result files", visible=bool(BENCH.downloads), file_count="multiple")

    # -- wiring ---------------------------------------------------------------------------------------
    outputs = dict(headline=headline, vanilla=vanilla_out, sdsat=sdsat_out, race_plot=race_plot,
                   accepted_plot=accepted_plot, position_plot=position_plot, pass_plot=pass_plot,
                   explorer_slider=iteration, explorer=explorer_out, record=record, run_data=run_data)
    settings = [prompt, model, chat, mode, k, max_new, temperature, top_p, top_k, seed]
    # lookup and tree last, after show_rejected: /race callers that send the earlier inputs keep working
    # preprocess=False: the page's own check (sdsat/ui/settings.py) parses what clients send, not the components
    run_event = run_btn.click(page.run_on_gpu, inputs=[*settings, show_rejected, lookup, tree],
                              outputs=[outputs[n] for n in RACE_OUTPUTS], api_name="race",
                              concurrency_limit=limits.concurrency, concurrency_id="model", preprocess=False)
    replay_event = replay_btn.click(page.replay, inputs=[record, show_rejected], outputs=[headline, vanilla_out, sdsat_out],
                                    api_visibility="private", concurrency_limit=8, concurrency_id="replay")
    stop_btn.click(None, cancels=[run_event, replay_event], api_visibility="private")
    show_rejected.change(page.sdsat_pane, [record, show_rejected], sdsat_out, api_visibility="private")
    mode.change(lambda m: (gr.Group(visible=m == "sampling"), gr.Slider(interactive=m == "greedy")), mode,
                [sampling_box, tree], api_visibility="private")
    model.change(page.model_controls, model, [k, chat, chat_examples], api_visibility="private", concurrency_id="model")
    iteration.input(page.explore, [record, iteration], explorer_out, api_visibility="private", preprocess=False)
    prev_btn.click(lambda r, i: page.step(r, i, -1), [record, iteration], [iteration, explorer_out],
                   api_visibility="private", preprocess=False)
    next_btn.click(lambda r, i: page.step(r, i, +1), [record, iteration], [iteration, explorer_out],
                   api_visibility="private", preprocess=False)
    gr.api(page.generate, api_name="generate", concurrency_limit=limits.concurrency, concurrency_id="model")
    demo.load(page.model_controls_if_loaded, model, [k, chat, chat_examples, headline], api_visibility="private")

close_direct_routes(demo)
demo.queue(max_size=limits.queue_size, default_concurrency_limit=limits.concurrency, api_open=False)
# launch() options from the operator's limits (the test servers use them too)
LAUNCH_OPTIONS = LAUNCH | {"state_session_capacity": limits.max_sessions}

if on_zero_gpu():
    page.preload()  # ZeroGPU wants the weights on CUDA at import; nothing is decoded outside a GPU call

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not on_zero_gpu():
        page.preload()  # load and warm up the default model before the first visitor
    demo.launch(**LAUNCH_OPTIONS)
