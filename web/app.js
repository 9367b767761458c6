// The chat page's entry: it imports the page's modules and wires them together.
//
//   dom.js            the page's elements, node building, the banner, announcements
//   state.js          the conversation on screen and the socket
//   settings.js       reply settings and the provenance tint (localStorage)
//   view.js           drawing turns, reply footers, the stats panel, the buttons' state
//   generation.js     a reply's life: request, streamed deltas, stop, done or failed
//   conversations.js  saving, listing and reopening conversations; "New chat"
//   composer.js       the message box, its keys, editing an earlier question
//   connection.js     connection status, server info, the API key dialog

// First: it moves a `?api_key=` out of the address bar before anything else runs.
import "./auth.js";
import { editTurn, initComposer } from "./composer.js";
import { connectIfAllowed, initConnection } from "./connection.js";
import { initConversations, refreshList } from "./conversations.js";
import { ui } from "./dom.js";
import { retryTurn } from "./generation.js";
import { initProvenance, initSettings } from "./settings.js";
import { renderStats, setTurnActions, updateControls } from "./view.js";

/** The side panel (settings and figures) opens over the chat on narrow screens. */
function initPanel() {
  const setPanel = (open) => {
    ui.sidebar.classList.toggle("open", open);
    ui.panelToggle.setAttribute("aria-expanded", String(open));
  };
  ui.panelToggle.addEventListener("click", () => setPanel(!ui.sidebar.classList.contains("open")));
  ui.sidebar.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && ui.sidebar.classList.contains("open")) {
      setPanel(false);
      ui.panelToggle.focus();
    }
  });
}

function init() {
  setTurnActions({ retry: retryTurn, edit: editTurn });
  initSettings();
  initComposer();
  initConversations();
  initProvenance();
  initPanel();
  initConnection();
  renderStats();
  updateControls();
  refreshList();
  ui.prompt.focus();
  connectIfAllowed();
}

init();
