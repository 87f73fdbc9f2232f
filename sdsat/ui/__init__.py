"""The web page's building blocks: settings and limits, the race, and HTML / plot rendering.

`app.py` at the repository root wires these to Gradio components; nothing here holds per-visitor state.
"""
