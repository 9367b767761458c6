// The reply settings (temperature, top-p, max tokens, speculation) and the provenance tint,
// both kept in localStorage so a reload keeps them.

import { ui } from "./dom.js";

const SETTINGS_KEY = "streamsd.settings";
const PROVENANCE_KEY = "streamsd.provenance";

export function readSettings() {
  const f = ui.settings.elements;
  const num = (input, lo, hi, fallback) => {
    const v = Number(input.value);
    return Number.isFinite(v) && input.value !== "" ? Math.min(hi, Math.max(lo, v)) : fallback;
  };
  return {
    temperature: num(f.temperature, 0, 2, 0.7),
    top_p: num(f.top_p, 0.01, 1, 1),
    max_tokens: Math.round(num(f.max_tokens, 1, Number(f.max_tokens.max) || 1e6, 512)),
    spec_enabled: f.spec_enabled.checked,
    spec_k: Math.round(num(f.spec_k, 1, 16, 4)),
  };
}

function loadSettings() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") || {};
  } catch {
    saved = {};
  }
  applySettings(saved);
}

export function applySettings(saved) {
  const f = ui.settings.elements;
  for (const key of ["temperature", "top_p", "max_tokens", "spec_k"]) {
    if (typeof saved[key] === "number") f[key].value = String(saved[key]);
  }
  if (typeof saved.spec_enabled === "boolean") f.spec_enabled.checked = saved.spec_enabled;
  f.spec_k.disabled = !f.spec_enabled.checked;
}

function saveSettings() {
  const s = readSettings();
  ui.settings.elements.spec_k.disabled = !s.spec_enabled;
  try {
    localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));
  } catch {
    // Private mode or storage full: settings just won't survive a reload.
  }
}

export function initSettings() {
  loadSettings();
  ui.settings.addEventListener("input", saveSettings);
  ui.settings.addEventListener("change", saveSettings);
  ui.settings.addEventListener("submit", (e) => e.preventDefault());
}

function setProvenance(on) {
  document.body.classList.toggle("show-provenance", on);
  ui.provenance.setAttribute("aria-checked", String(on));
  try {
    localStorage.setItem(PROVENANCE_KEY, on ? "1" : "0");
  } catch {
    // not persisted; fine
  }
}

/** The provenance switch, starting as the last visit left it. */
export function initProvenance() {
  ui.provenance.addEventListener("click", () => setProvenance(!document.body.classList.contains("show-provenance")));
  let provenance = false;
  try {
    provenance = localStorage.getItem(PROVENANCE_KEY) === "1";
  } catch {
    // storage blocked: start with the tint off
  }
  setProvenance(provenance);
}
