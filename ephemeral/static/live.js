// The run page follows its run: each server-sent message carries the HTML row the server
// rendered for the event (the same macro as the first paint), so no wording lives here.
const run = document.getElementById("run");

function follow() {
  if (!run || run.dataset.live !== "1") return;
  const timeline = document.getElementById("timeline");
  const state = document.getElementById("live-state");
  let last = Number(run.dataset.after || "0");
  const url = `/runs/${encodeURIComponent(run.dataset.runId)}/live?after=${last}&t0=${encodeURIComponent(run.dataset.t0 || "")}`;
  const source = new EventSource(url);
  source.onmessage = (msg) => {
    const ev = JSON.parse(msg.data);
    if (ev.seq <= last) return; // a resumed stream may repeat what we already show
    last = ev.seq;
    timeline.insertAdjacentHTML("beforeend", ev.html);
    if (ev.summary_html) {
      document.getElementById("summary").outerHTML = ev.summary_html;
    }
    if (ev.type === "run.settled") {
      source.close(); // the stream ends here; EventSource would otherwise reconnect
      run.dataset.live = "0";
      run.dataset.settled = "1";
      state.textContent = "Settled.";
    }
  };
  source.onerror = () => {
    if (run.dataset.live === "1") state.textContent = "Reconnecting…";
  };
  source.onopen = () => {
    if (run.dataset.live === "1") state.textContent = "Following live…";
  };
}

follow();
