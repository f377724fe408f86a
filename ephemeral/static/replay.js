// Replays a recorded run: rows appear at their recorded offsets, scaled by the chosen speed.
const timeline = document.getElementById("timeline");
const rows = Array.from(timeline.querySelectorAll("li.ev"));
const play = document.getElementById("play");
const restart = document.getElementById("restart");
const speed = document.getElementById("speed");
const progress = document.getElementById("progress");

let clock = 0; // recorded milliseconds already played
let shown = 0;
let timer = null;
let lastTick = 0;

function render() {
  rows.forEach((row, i) => row.classList.toggle("hidden", i >= shown));
  progress.textContent = `${shown} of ${rows.length} steps`;
  timeline.dataset.done = shown === rows.length ? "1" : "0";
}

function tick() {
  const now = performance.now();
  clock += (now - lastTick) * Number(speed.value);
  lastTick = now;
  while (shown < rows.length && Number(rows[shown].dataset.offset) <= clock) shown += 1;
  render();
  if (shown >= rows.length) pause();
}

function start() {
  if (shown >= rows.length) reset();
  lastTick = performance.now();
  timer = setInterval(tick, 50);
  play.textContent = "Pause";
  play.dataset.state = "playing";
  tick();
}

function pause() {
  clearInterval(timer);
  timer = null;
  play.textContent = shown >= rows.length ? "Replay" : "Play";
  play.dataset.state = "paused";
}

function reset() {
  clock = 0;
  shown = 0;
  render();
}

play.addEventListener("click", () => (timer ? pause() : start()));
restart.addEventListener("click", () => {
  pause();
  reset();
  start();
});
reset();
