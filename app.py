"""The SDSAT web demo: vanilla decoding races SDSAT on your prompt, with colour-coded tokens,
a step explorer and latency plots. Run `python app.py` (or `make demo`); a Hugging Face Space runs
this file as it is.

This file only wires components to `sdsat.ui`; operator limits come from environment variables
(see `sdsat/ui/settings.py` and the README's "Limits and safety").
"""

from __future__ import annotations

import logging

import sdsat  # noqa: F401  (first: run as `python app.py`, it makes Ctrl-C during start-up one line and exit 130)
import spaces  # noqa: F401  (then: on ZeroGPU it must patch torch before anything starts CUDA; sdsat imports no torch)
import gradio as gr

from sdsat import ASSETS
from sdsat.checkpoints import known_checkpoint
from sdsat.decoding import MAX_TREE_CANDIDATES
from sdsat.ui.benchmark import bench_page, short_machine
from sdsat.ui.chat import Chat
from sdsat.ui.events import calm_queue, close_direct_routes, postprocessed
from sdsat.ui.examples import CHAT_EXAMPLES, EXAMPLE_LABELS, EXAMPLES
from sdsat.ui.handlers import MODEL_OUTPUTS, RACE_INPUTS, RACE_OUTPUTS, Page
from sdsat.ui.presets import CUSTOM, DEFAULT_SCHEME, FALLBACK, PAGE_SAMPLING, SCHEME_LABELS
from sdsat.ui.render import legend_html, waiting_html
from sdsat.ui.replay import REPLAY_JS, REPLAY_STATUS
from sdsat.sampling import MAX_SEED, MAX_TEMPERATURE, MAX_TOP_K
from sdsat.ui.settings import Limits
from sdsat.ui.style import LAUNCH
from sdsat.ui.zerogpu import on_zero_gpu

DIAGRAM = ASSETS / "sdsat_diagram.svg"
HOW_IT_WORKS = ASSETS / "how_it_works.md"
GLOSSARY = ASSETS / "glossary.md"

limits = Limits.from_env()
page = Page(limits)  # the engine cache inside is the only object shared between visitors
chat_page = Chat(limits, page.cache)
bench = bench_page()  # read once at start: every visitor sees the same files, and no page load reads them again
_checkpoint = known_checkpoint(limits.models[0])
CHAT_SHOWN = _checkpoint is None or _checkpoint.chat  # until the model has loaded and says for itself
RAW_EXAMPLES = [(row, label) for row, label in zip(EXAMPLES, EXAMPLE_LABELS) if not row[1]]
CHAT_PROMPT_EXAMPLES = [(row, label) for row, label in zip(EXAMPLES, EXAMPLE_LABELS) if row[1]]


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
                gr.Examples([row for row, _ in RAW_EXAMPLES], inputs=[prompt, chat], api_visibility="private",
                            label="Examples (what each gives was checked on this model)",
                            example_labels=[label for _, label in RAW_EXAMPLES])
                with gr.Column(visible=CHAT_SHOWN) as chat_examples:  # only for a model with a chat template
                    gr.Examples([row for row, _ in CHAT_PROMPT_EXAMPLES], inputs=[prompt, chat],
                                api_visibility="private", label="Chat examples",
                                example_labels=[label for _, label in CHAT_PROMPT_EXAMPLES])
                scheme = gr.Radio([*SCHEME_LABELS, CUSTOM], value=DEFAULT_SCHEME, label="Scheme", elem_id="scheme",
                                  info="auto: the k, prompt lookup and draft tree predicted fastest from this "
                                       "machine's pass costs, measured once, behind the page (see This machine, under "
                                       "the plots). "
                                       "paper: the paper's two-step SATs alone. In both, greedy output is identical to "
                                       "vanilla's and sampled output has the same distribution.")
                # what auto chose here and why, or why it keeps its defaults (filled once the model has loaded)
                auto_note = gr.HTML("", js_on_load=None, elem_id="auto-note")
                # While this machine is measured behind the page: the note and This machine follow the measurement,
                # and auto's sliders take the plan when it is ready (Page.plan_watch stops the timer then).
                plan_timer = gr.Timer(1.0, active=True)
                plan_watched = gr.State(False, time_to_live=limits.state_ttl_s)  # this page saw the measurement
                with gr.Accordion("Settings", open=True):
                    mode = gr.Radio(["greedy", "sampling"], value="greedy", label="Decoding",
                                    info="Greedy output must be identical to vanilla; the page checks it.")
                    k = gr.Slider(1, 8, value=FALLBACK["k"], step=1, label="k: adaptive tokens (drafts) per step",
                                  elem_id="k")
                    max_new = gr.Slider(1, limits.max_new_tokens, value=min(64, limits.max_new_tokens), step=1,
                                        label="Max new tokens", elem_id="max-new")
                    lookup = gr.Slider(0, 16, value=FALLBACK["lookup_tokens"], step=1, elem_id="lookup",
                                       label="Prompt lookup: copied tokens to verify (0 = off)",
                                       info="Not in the paper: where the last tokens occurred before, SDSAT verifies "
                                            "up to this many tokens copied from there instead of SAT drafts. "
                                            "Fast on code, which repeats its names; greedy output stays identical.")
                    tree = gr.Slider(0, MAX_TREE_CANDIDATES, value=FALLBACK["tree_candidates"], step=1, elem_id="tree",
                                     label="Draft tree: runner-up candidates to verify too (0 = off)",
                                     info="Not in the paper: the verify pass also checks the SATs' second choices "
                                          "(sampling: further draws, tried in turn). They make the verify pass wider: "
                                          "on a GPU almost free, on a CPU often not (auto adds them only where this "
                                          "machine's measured pass costs say they pay; see This machine).")
                    with gr.Group(visible=False) as sampling_box:
                        temperature = gr.Slider(0.05, MAX_TEMPERATURE, value=PAGE_SAMPLING["temperature"], step=0.05,
                                                label="Temperature")
                        top_p = gr.Slider(0.05, 1.0, value=PAGE_SAMPLING["top_p"], step=0.01, label="Top-p")
                        top_k = gr.Slider(0, MAX_TOP_K, value=PAGE_SAMPLING["top_k"], step=1, label="Top-k (0 = off)")
                        seed = gr.Number(value=0, precision=0, minimum=0, maximum=MAX_SEED, label="Seed")
                    model = gr.Dropdown(limits.models, value=limits.models[0], label="Model",
                                        info="Only models the operator has listed.", interactive=len(limits.models) > 1)
                    show_rejected = gr.Checkbox(label="Show rejected drafts (struck through)", value=False)
            with gr.Column(scale=2):
                headline = gr.HTML('<div class="check info">Press <b>Run the race</b>. Vanilla decoding runs first, '
                                   'then SDSAT — one after the other, never at the same time, because on a 2-core '
                                   'machine they would slow each other down. <b>Replay</b> then shows both on one '
                                   'clock.</div>',
                                   js_on_load=None, label="headline")
                with gr.Row(equal_height=False):
                    with gr.Column(min_width=280):
                        gr.HTML('<div class="pane-title">Vanilla decoding '
                                '<span class="muted">· one token per forward pass</span></div>', js_on_load=None)
                        vanilla_out = gr.HTML(waiting_html("Vanilla output appears here."), js_on_load=None,
                                              elem_id="vanilla-out", label="vanilla_output")
                    with gr.Column(min_width=280):
                        gr.HTML('<div class="pane-title">SDSAT <span class="muted">'
                                '· draft with SATs, verify in one pass</span></div>', js_on_load=None)
                        sdsat_out = gr.HTML(waiting_html("SDSAT output appears here, "
                                                         "coloured by where each token came from."),
                                            js_on_load=None, elem_id="sdsat-out", label="sdsat_output")
                gr.HTML(legend_html(), js_on_load=None)
                replay_btn = gr.Button("▶ Replay both on one clock, at the measured speed", size="sm")
                gr.HTML(REPLAY_STATUS, elem_id="replay-status", js_on_load=None)

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
        # Measured when the model loaded (Engine.tune) and built once; filled on page load.
        with gr.Accordion("This machine: what a forward pass costs here, and what auto chose", open=False,
                          elem_id="machine-box"):
            machine = gr.HTML("", js_on_load=None, elem_id="machine")
            machine_plot = gr.Plot(label="Pass cost", show_label=False, elem_id="machine-plot")
            # Measured on request, not at load: a few seconds of the compute thread (sdsat/ui/pass_time.py).
            split_btn = gr.Button("Split a pass: where its time goes here (measures for a few seconds)", size="sm",
                                  elem_id="split-btn")
            split_out = gr.HTML("", elem_id="pass-split")
            split_plot = gr.Plot(label="Pass split", show_label=False, elem_id="pass-split-plot")
        with gr.Accordion("Metrics, defined", open=False):
            gr.Markdown(
                "- **Tokens/s**: new tokens ÷ wall time of the request (prompt reading included), "
                "measured inside the decoder.\n"
                "- **Speed-up**: SDSAT tokens/s ÷ vanilla tokens/s, same prompt, same run, same machine, both in the "
                "same numerics; where another precision or form of vanilla is faster here, the headline adds the "
                "speed-up against that fastest vanilla (estimated from the measured pass times).\n"
                "- **Tokens per iteration** (mean accepted length): new tokens per SDSAT iteration, *counting* the "
                "step-1 token t and the bonus token — so it is 2 + accepted drafts, "
                "and 2.0 means no draft was accepted "
                "(1 + accepted copies when prompt lookup's copies were verified without a draft pass).\n"
                "- **Forward passes per token**: forward passes of the model ÷ new tokens (vanilla: 1.0). "
                "Each SDSAT iteration costs 2 passes "
                "(1 when prompt lookup's copies are verified without a draft pass).\n"
                "- **Acceptance rate per draft position**: of the iterations that drafted position *i*, "
                "the share in which draft *i* was accepted.\n"
                "- **Timing honesty**: the two decoders run one after the other in a worker thread that does nothing "
                "else; the page updates in between never fall inside a decoder's clock.")
        with gr.Accordion("Glossary: the terms this page uses", open=False, elem_id="glossary"):
            gr.Markdown(GLOSSARY.read_text() if GLOSSARY.is_file() else "")
        with gr.Accordion("Run data (JSON, also returned by the API)", open=False):
            run_data = gr.JSON(label="Run data")

    with gr.Tab("Chat", visible=CHAT_SHOWN):  # a conversation needs the model's chat template
        gr.Markdown("A conversation in which **every reply is decoded by SDSAT** (auto's settings; see Chat "
                    "settings), coloured like the race: hover a token for its step and probability. The badge under a "
                    "reply gives its tokens/s and tokens per forward pass. The check against vanilla decoding runs "
                    "**only when you press *Race this turn***, so a reply arrives as fast as SDSAT gives it and your "
                    "next message never waits behind a check. The conversation goes through the model's chat "
                    "template; when it outgrows "
                    "the prompt limit the oldest messages are left out, and the reply says so.")
        turns = gr.State([], time_to_live=limits.state_ttl_s)  # this visitor's conversation (ChatTurn records)
        chatbot = gr.Chatbot(elem_id="chatbot", height=480, show_label=False, feedback_options=None,
                             placeholder="Say something, or pick an example below.", buttons=["copy"])
        with gr.Row():
            chat_msg = gr.Textbox(show_label=False, placeholder="Your message", lines=1, max_lines=6, scale=5,
                                  elem_id="chat-msg", min_width=200)
            send_btn = gr.Button("Send", variant="primary", scale=1, min_width=80)
        with gr.Row():
            race_turn_btn = gr.Button("Race this turn against vanilla", size="sm", min_width=150)
            regen_btn = gr.Button("↻ Regenerate", size="sm", min_width=100)
            chat_stop_btn = gr.Button("Stop", variant="stop", size="sm", min_width=70)
            clear_btn = gr.Button("Clear conversation", size="sm", min_width=70)
        gr.HTML(legend_html(False), js_on_load=None)
        gr.Examples(CHAT_EXAMPLES, inputs=[chat_msg], label="Examples", api_visibility="private")
        with gr.Accordion("Chat settings", open=False):
            chat_scheme = gr.Radio(list(SCHEME_LABELS), value=DEFAULT_SCHEME, label="Scheme")
            chat_mode = gr.Radio(["greedy", "sampling"], value="greedy", label="Decoding",
                                 info="Greedy: Regenerate gives the same reply. Sampling (top-p 0.95, top-k 50): a new "
                                      "one each time.")
            chat_temperature = gr.Slider(0.05, MAX_TEMPERATURE, value=0.8, step=0.05, label="Temperature (sampling)")
            chat_max_new = gr.Slider(1, limits.max_new_tokens, value=min(128, limits.max_new_tokens), step=1,
                                     label="Max new tokens per reply")

    with gr.Tab("How it works"):
        gr.HTML(f'<div class="diagram">{DIAGRAM.read_text()}</div>' if DIAGRAM.is_file() else "", js_on_load=None)
        gr.Markdown(HOW_IT_WORKS.read_text() if HOW_IT_WORKS.is_file() else "", elem_classes="howto")

    with gr.Tab("Benchmark"):
        gr.Markdown(bench.intro, elem_id="bench-intro")
        if bench.figure is not None:
            gr.Plot(bench.figure, show_label=False, elem_id="bench-chart")
        else:
            gr.HTML(bench.message, js_on_load=None)
        def suite_box(suite):
            with gr.Accordion(f"{suite.title} · {short_machine(suite.machine)}", open=False):
                gr.HTML(suite.html, js_on_load=None)
                if suite.downloads:
                    gr.File(value=suite.downloads, file_count="multiple", label=f"{suite.key}: result files",
                            interactive=False)

        question = None
        for suite in bench.suites:  # the latest suite per question, grouped under it
            if suite.question != question:
                question = suite.question
                gr.Markdown(f"#### {question}", elem_classes="bench-question")
            suite_box(suite)
        if bench.history:
            with gr.Accordion(f"History: {len(bench.history)} earlier suites, newest first (other adapters, "
                              "code and settings)", open=False, elem_id="bench-history"):
                for suite in bench.history:
                    suite_box(suite)

    # -- wiring ---------------------------------------------------------------------------------------
    outputs = dict(headline=headline, vanilla=vanilla_out, sdsat=sdsat_out, race_plot=race_plot,
                   accepted_plot=accepted_plot, position_plot=position_plot, pass_plot=pass_plot,
                   explorer_slider=iteration, explorer=explorer_out, record=record, run_data=run_data)
    race_inputs = dict(prompt=prompt, model=model, chat=chat, mode=mode, k=k, max_new_tokens=max_new,
                       temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, show_rejected=show_rejected,
                       lookup_tokens=lookup, tree_candidates=tree)
    # /race's positional order is RACE_INPUTS (sdsat/ui/handlers.py): lookup and tree last, after show_rejected,
    # so that /race callers that send the earlier inputs keep working.
    # preprocess=False: the page's own parsing (sdsat/ui/settings.py) reads what clients send, not the components
    # postprocess=False: the race's snapshots are postprocessed on its own thread (events.postprocessed)
    race_outputs = [outputs[n] for n in RACE_OUTPUTS]
    race_event = run_btn.click(postprocessed(page.race_on_gpu, race_outputs),
                               inputs=[race_inputs[n] for n in RACE_INPUTS], outputs=race_outputs, api_name="race",
                               concurrency_limit=limits.concurrency, concurrency_id="model", preprocess=False,
                               postprocess=False)
    replay_btn.click(None, js=REPLAY_JS, api_visibility="private")  # plays in the browser: no server call
    stop_btn.click(None, cancels=[race_event], api_visibility="private")
    scheme.input(page.scheme_controls, [scheme, model, mode], [k, lookup, tree], api_visibility="private")
    for slider in (k, lookup, tree):
        slider.input(page.scheme_label, [k, lookup, tree, model, mode], scheme, api_visibility="private")
    show_rejected.change(page.sdsat_pane, [record, show_rejected], sdsat_out, api_visibility="private")
    mode.change(page.mode_controls, [mode, scheme, model], [sampling_box, k, lookup, tree], api_visibility="private")
    model_outputs = dict(k=k, lookup_tokens=lookup, tree_candidates=tree, scheme=scheme, auto_note=auto_note, chat=chat,
                         chat_examples=chat_examples, machine=machine, machine_plot=machine_plot)
    model.change(page.model_controls, [model, mode], [model_outputs[n] for n in MODEL_OUTPUTS],
                 api_visibility="private", concurrency_id="model")
    split_btn.click(page.pass_split, [model], [split_out, split_plot], api_visibility="private",
                    concurrency_id="model")
    iteration.input(page.explore, [record, iteration], explorer_out, api_visibility="private", preprocess=False)
    prev_btn.click(lambda r, i: page.step(r, i, -1), [record, iteration], [iteration, explorer_out],
                   api_visibility="private", preprocess=False)
    next_btn.click(lambda r, i: page.step(r, i, +1), [record, iteration], [iteration, explorer_out],
                   api_visibility="private", preprocess=False)
    gr.api(page.generate, api_name="generate", concurrency_limit=limits.concurrency, concurrency_id="model")

    chat_inputs = [model, chat_scheme, chat_mode, chat_temperature, chat_max_new]
    chat_events = [
        trigger(fn, inputs, [chatbot, turns, chat_msg], api_visibility="private", concurrency_limit=limits.concurrency,
                concurrency_id="model")
        for trigger, fn, inputs in ((send_btn.click, chat_page.respond_on_gpu, [chat_msg, turns, *chat_inputs]),
                                    (chat_msg.submit, chat_page.respond_on_gpu, [chat_msg, turns, *chat_inputs]),
                                    (regen_btn.click, chat_page.regenerate_on_gpu, [turns, *chat_inputs]))]
    chat_events.append(race_turn_btn.click(chat_page.race_turn_on_gpu, turns, [chatbot, turns],
                                           api_visibility="private", concurrency_limit=limits.concurrency,
                                           concurrency_id="model"))
    chat_stop_btn.click(chat_page.stopped, turns, [chatbot, turns], cancels=chat_events, api_visibility="private")
    clear_btn.click(chat_page.clear, None, [chatbot, turns], cancels=chat_events, api_visibility="private")
    chatbot.clear(chat_page.clear, None, [chatbot, turns], cancels=chat_events,
                  api_visibility="private")  # the Chatbot's own bin icon
    gr.api(chat_page.turn, api_name="chat", concurrency_limit=limits.concurrency, concurrency_id="model")
    plan_timer.tick(page.plan_watch, [model, mode, scheme, plan_watched],
                    [auto_note, machine, machine_plot, k, lookup, tree, plan_timer, plan_watched],
                    api_visibility="private")
    demo.load(page.model_controls_if_loaded, [model, mode], [*(model_outputs[n] for n in MODEL_OUTPUTS), headline],
              api_visibility="private")

close_direct_routes(demo)
demo.queue(max_size=limits.queue_size, default_concurrency_limit=limits.concurrency, api_open=False)
calm_queue(demo)
# launch() options from the operator's limits (the test servers use them too)
LAUNCH_OPTIONS = LAUNCH | {"state_session_capacity": limits.max_sessions}

if on_zero_gpu():
    page.preload()  # ZeroGPU wants the weights on CUDA at import; nothing is decoded outside a GPU call

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    if not on_zero_gpu():
        page.preload()  # load and warm up the default model before the first visitor
    demo.launch(**LAUNCH_OPTIONS)
