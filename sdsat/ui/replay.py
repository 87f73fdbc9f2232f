"""Replay in the browser: both panes grow again on one clock, from the timings recorded in their HTML.

Every token span carries `data-t`, the seconds since its decoder's request started when it was
emitted (render.py). The replay is this JavaScript, run by the button itself: it sends nothing to
the server, so it holds no queue worker however long it plays.
"""

MAX_REPLAY_S = 60.0  # a longer race replays its first minute

REPLAY_JS = """
() => {
  const status = document.querySelector('#replay-status .replay-status');
  const panes = ['#vanilla-out', '#sdsat-out'].map((id) => document.querySelector(id + ' .sdsat-out'));
  const say = (text, state) => { if (status) { status.textContent = text; status.dataset.state = state; } };
  if (panes.some((p) => !p || !p.querySelector('.tok[data-t]'))) {
    say('Run the race first: the replay plays its recorded timings.', 'empty');
    return;
  }
  if (window.sdsatReplay) clearInterval(window.sdsatReplay);
  const parts = panes.map((p) => Array.from(p.querySelectorAll('[data-t]')));
  const times = parts.map((list) => list.map((el) => parseFloat(el.dataset.t)));
  const total = Math.min(MAX_S, Math.max(...times.flat()));
  const start = performance.now();
  const tick = () => {
    if (!document.contains(parts[0][0]) || !document.contains(parts[1][0])) {  // a new race replaced the panes
      clearInterval(window.sdsatReplay);
      say('', 'stopped');
      return;
    }
    const now = Math.min((performance.now() - start) / 1000, total);
    const shown = parts.map((list, i) => {
      let n = 0;
      list.forEach((el, j) => {
        const visible = times[i][j] <= now;
        el.classList.toggle('replay-hidden', !visible);
        if (visible && el.classList.contains('tok') && !el.classList.contains('src-rejected')) n += 1;
      });
      return n;
    });
    const done = now >= total;
    say(`Replay at the measured speed: ${now.toFixed(2)} s · vanilla ${shown[0]} tokens · SDSAT ${shown[1]} tokens`
        + (done ? ' · done' : ''), done ? 'done' : 'playing');
    if (done) clearInterval(window.sdsatReplay);
  };
  window.sdsatReplay = setInterval(tick, 40);
  tick();
}
""".replace("MAX_S", repr(MAX_REPLAY_S))

REPLAY_STATUS = '<div class="replay-status muted" data-state="idle"></div>'
