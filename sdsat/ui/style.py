"""The page's look: a Gradio theme and the CSS for tokens, cards, the explorer and tables.

Gradio 6 takes both in `launch(theme=..., css=...)`. The panes set their own text and background
colours, so they read the same in the browser's light and dark modes.
"""

import gradio as gr

THEME = gr.themes.Soft(primary_hue="violet", secondary_hue="emerald", neutral_hue="slate",
                       font=[gr.themes.Font(f) for f in ("Inter", "system-ui", "Segoe UI", "sans-serif")],
                       font_mono=[gr.themes.Font(f) for f in ("JetBrains Mono", "ui-monospace", "Menlo", "monospace")])
# Plain font names, no web fonts: the page works offline.

CSS = """
.gradio-container { max-width: 1400px !important; }
#title h1 { margin-bottom: 0; }
#title p { margin-top: 4px; color: #475569; }

/* output panes */
.sdsat-out { font-family: 'JetBrains Mono', ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13.5px;
  line-height: 1.75; white-space: pre-wrap; word-break: break-word; color: #0f172a; background: #ffffff;
  border: 1px solid #e2e8f0; border-radius: 10px; padding: 12px 14px; min-height: 170px; max-height: 460px;
  overflow-y: auto; }
.sdsat-out.waiting { display: flex; align-items: center; justify-content: center; }
.placeholder { color: #94a3b8; font-style: italic; font-family: Inter, system-ui, sans-serif; white-space: normal; }
.pane-title { font-weight: 600; font-size: 15px; margin: 2px 0 6px 2px; color: var(--body-text-color); }
.pane-title .muted { font-weight: 400; }

.tok { border-radius: 3px; padding: 1px 0; cursor: help; }
.tok.empty::after { content: "·"; color: #94a3b8; }
.tok.special { font-size: 11px; padding: 1px 3px; border: 1px dashed #94a3b8; color: #475569; }
.src-vanilla.shade0 { background: #f1f5f9; }
.src-vanilla.shade1 { background: #e2e8f0; }
.src-verified { background: #dbeafe; box-shadow: inset 0 -2px 0 #3b82f6; }
.src-draft { background: #d1fae5; box-shadow: inset 0 -2px 0 #10b981; }
.src-bonus { background: #fef3c7; box-shadow: inset 0 -2px 0 #f59e0b; }
.src-copy { background: #cffafe; box-shadow: inset 0 -2px 0 #0891b2; }
.src-rejected { margin: 0 1px; background: #fee2e2; color: #b91c1c; text-decoration: line-through;
  text-decoration-thickness: 2px; opacity: .85; }
.iter { border-left: 2px solid #a78bfa; margin-left: 1px; padding-left: 1px; }
.iter-mark { display: inline-block; width: 2px; height: 14px; background: #a78bfa; vertical-align: middle; }

.legend { display: flex; flex-wrap: wrap; gap: 6px 16px; align-items: center; font-size: 13px;
  color: var(--body-text-color); margin: 6px 0 2px; }
.legend .tok { font-family: 'JetBrains Mono', ui-monospace, monospace; padding: 1px 5px; }
.legend-item { display: inline-flex; align-items: center; gap: 6px; }
.muted { color: #64748b; }

/* headline */
.headline { display: flex; flex-direction: column; gap: 8px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(140px, 1fr)); gap: 8px; }
.card { background: #ffffff; border: 1px solid #e2e8f0; border-radius: 12px; padding: 10px 14px; color: #0f172a; }
.card .value { font-size: 22px; white-space: nowrap; font-weight: 700; letter-spacing: -0.02em; }
.card .label { font-size: 13px; font-weight: 600; color: #334155; }
.card .note { font-size: 11.5px; color: #64748b; margin-top: 2px; }
.card.accent { background: linear-gradient(135deg, #f5f3ff, #ede9fe); border-color: #c4b5fd; }
.card.accent .value { color: #6d28d9; }
.why { font-size: 12.5px; }
.check { border-radius: 10px; padding: 9px 14px; font-size: 14px; }
.check.ok { background: #ecfdf5; border: 1px solid #6ee7b7; color: #065f46; font-weight: 600; }
.check.bad { background: #fef2f2; border: 1px solid #fca5a5; color: #991b1b; font-weight: 600; }
.check.info { background: #f8fafc; border: 1px solid #cbd5e1; color: #334155; }
.meta { font-size: 12.5px; color: #64748b; display: flex; flex-wrap: wrap; gap: 6px; align-items: center; }
.badge { border-radius: 999px; padding: 2px 10px; font-weight: 600; font-size: 12px; }
.badge.ok { background: #d1fae5; color: #065f46; }
.badge.warn { background: #fef3c7; color: #92400e; }
.headline.running .status { background: #f5f3ff; border: 1px solid #ddd6fe; color: #4c1d95; border-radius: 10px;
  padding: 10px 14px; font-size: 14px; }
.spinner { display: inline-block; width: 12px; height: 12px; margin-right: 8px; border: 2px solid #c4b5fd;
  border-top-color: #6d28d9; border-radius: 50%; animation: sdsat-spin .8s linear infinite; vertical-align: -1px; }
@keyframes sdsat-spin { to { transform: rotate(360deg); } }

/* step explorer */
.explorer { color: #0f172a; background: #ffffff; border: 1px solid #e2e8f0; border-radius: 12px; padding: 12px 14px;
  font-size: 13.5px; }
.explorer.empty { color: #64748b; font-style: italic; }
.ex-head { margin-bottom: 8px; }
.ex-context, .ex-result { margin: 8px 0; display: flex; flex-wrap: wrap; gap: 4px; align-items: center; }
.ex-label { font-weight: 600; color: #334155; margin-right: 6px; }
.ex-scroll { overflow-x: auto; }
.ex-table { border-collapse: separate !important; border-spacing: 4px 4px; border: none !important;
  margin: 0 !important; }
.ex-table tr, .ex-table td, .ex-table th { border: none !important; background: transparent !important;
  padding: 3px 4px !important; }
.ex-table th { font-size: 12px; color: #64748b; font-weight: 600; text-align: center; }
.ex-table th.row { text-align: right; padding-right: 8px; white-space: nowrap; color: #334155; }
.ex-table td { text-align: center; vertical-align: top; min-width: 62px; }
.chip { display: inline-block; font-family: 'JetBrains Mono', ui-monospace, monospace; font-size: 12.5px;
  padding: 2px 6px; border-radius: 6px; background: #f1f5f9; border: 1px solid #e2e8f0; white-space: pre;
  max-width: 160px; overflow: hidden; text-overflow: ellipsis; }
.chip.pending { background: #ede9fe; border-color: #a78bfa; }
.chip.sat { background: #1e1b4b; color: #e0e7ff; border-color: #1e1b4b; }
.chip.draft { background: #ecfdf5; border-color: #a7f3d0; }
.chip.pred { background: #fff7ed; border-color: #fed7aa; }
.chip.src-verified, .chip.src-draft, .chip.src-copy, .chip.src-bonus { box-shadow: none; }
.chip.src-verified { border-color: #93c5fd; } .chip.src-draft { border-color: #6ee7b7; }
.chip.src-bonus { border-color: #fcd34d; }
.chip.src-copy, .chip.copy { border-color: #67e8f9; } .chip.copy { background: #ecfeff; }
.chip.tree-no { background: #fef2f2; border-color: #fecaca; text-decoration: line-through; }
.chip.tree-skip { opacity: .45; }
.tree-node { white-space: nowrap; margin-bottom: 2px; }
.sub { font-size: 10.5px; color: #64748b; margin-top: 2px; }
.verdict { display: inline-block; font-size: 12px; font-weight: 600; border-radius: 6px; padding: 2px 6px;
  margin-bottom: 3px; }
.verdict.ok { color: #065f46; background: #d1fae5; }
.verdict.bad { color: #991b1b; background: #fee2e2; }
.verdict.skip { color: #64748b; background: #f1f5f9; font-weight: 400; }
.ex-rule { font-size: 12.5px; }
.ex-tests { margin-top: 10px; }
.accept-tests td { font-variant-numeric: tabular-nums; font-size: 12.5px; vertical-align: middle; }
.accept-tests td:last-child { text-align: left; white-space: nowrap; }
.chip.resid { background: #f8fafc; }
.sub-inline { font-size: 10.5px; color: #64748b; margin: 0 6px 0 2px; }

/* how it works / benchmark */
.howto { color: var(--body-text-color); }
.diagram { background: #ffffff; border: 1px solid #e2e8f0; border-radius: 12px; padding: 8px; overflow-x: auto; }
.diagram svg { max-width: 100%; height: auto; }
.bench-scroll { overflow-x: auto; }
.bench-table { border-collapse: collapse; font-size: 13px; color: #0f172a; background: #fff; }
.bench-table th, .bench-table td { border: 1px solid #e2e8f0; padding: 4px 8px; text-align: right; }
.bench-table th { background: #f8fafc; }
.bench-notes { font-size: 13px; color: var(--body-text-color); }
.bench-left-out { font-size: 12px; margin-top: 4px; }

/* replay (played in the browser, replay.py) */
.replay-hidden { display: none !important; }
.replay-status { font-size: 13px; min-height: 1.2em; }

/* chat: a reply is a race pane without its frame, with a badge under it */
.chat-user { white-space: pre-wrap; word-break: break-word; }
.chat-turn .sdsat-out { min-height: 0; max-height: none; border: none; padding: 0; background: transparent;
  overflow: visible; }
.turn-badge { display: flex; flex-wrap: wrap; gap: 4px 6px; align-items: center; margin-top: 8px; font-size: 12px;
  font-family: Inter, system-ui, sans-serif; white-space: normal; }
.turn-badge .badge { background: #f1f5f9; color: #334155; font-weight: 600; }
.turn-badge .badge.speed { background: #ede9fe; color: #5b21b6; }
.turn-badge .badge.ok { background: #d1fae5; color: #065f46; }
.turn-badge .badge.bad { background: #fee2e2; color: #991b1b; }
.turn-badge .badge.warn { background: #fef3c7; color: #92400e; }
.turn-badge .badge.run { background: #f5f3ff; color: #4c1d95; }
.turn-badge .badge.trimmed { font-weight: 400; }
#chatbot .message-content, #chatbot .message { max-width: 100%; }

/* phone width: nothing may push the page sideways; wide parts scroll inside themselves */
#explorer { max-width: 100%; }
.explorer { max-width: 100%; overflow-x: auto; }
.js-plotly-plot, .plot-container { max-width: 100%; }
@media (max-width: 600px) {
  .gradio-container { padding: 0 6px !important; }
  .sdsat-out { font-size: 12.5px; max-height: 340px; }
  .card { padding: 8px 10px; }
  .card .value { font-size: 18px; }
  .cards { grid-template-columns: repeat(2, minmax(0, 1fr)); }
  .ex-table td { min-width: 48px; }
  .ex-table th.row { white-space: normal; min-width: 84px; max-width: 96px; font-size: 11px; }
  .chip { max-width: 110px; }
  .diagram svg { min-width: 0; }
}
"""

LAUNCH = {"theme": THEME, "css": CSS}
