"""The training record as a plotly figure: SAT loss per offset and held-out acceptance per draft position."""

from __future__ import annotations


def record_figure(record: dict, smooth: int = 9):
    """Two panels: loss of SAT j against step (moving average over `smooth` steps), and the held-out
    teacher-forced acceptance of draft position j at each evaluation, per data source (a plotly figure;
    imported here, so that training runs where plotly is missing, as on a lent GPU machine)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("SAT loss per offset (moving average)",
                                                        "held-out acceptance per draft position"))
    steps = record["steps"]
    offsets = len(steps[0]["loss_by_offset"]) if steps else 0
    for j in range(offsets):
        values = [s["loss_by_offset"][j] for s in steps]
        averaged = [sum(values[max(0, i - smooth + 1):i + 1]) / len(values[max(0, i - smooth + 1):i + 1])
                    for i in range(len(values))]
        fig.add_trace(go.Scatter(x=[s["step"] for s in steps], y=averaged, name=f"SAT {j + 1} loss",
                                 legendgroup="loss", mode="lines"), row=1, col=1)
    for source in sorted({name for e in record["evals"] for name in e["acceptance_by_position"]}):
        evals = [e for e in record["evals"] if source in e["acceptance_by_position"]]
        for j in range(len(evals[0]["acceptance_by_position"][source])):
            fig.add_trace(go.Scatter(x=[e["step"] for e in evals],
                                     y=[e["acceptance_by_position"][source][j] for e in evals],
                                     name=f"{source}: draft {j + 1}", legendgroup=source, mode="lines+markers"),
                          row=1, col=2)
    fig.update_xaxes(title_text="optimizer step")
    fig.update_yaxes(title_text="cross-entropy (nats)", row=1, col=1)
    fig.update_yaxes(title_text="accepted share", range=[0, 1], row=1, col=2)
    fig.update_layout(template="plotly_white", height=420, width=1100, margin=dict(t=60, l=60, r=20, b=50))
    return fig
