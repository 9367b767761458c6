// The page's elements and the small DOM helpers every part of the chat uses: building nodes,
// keeping the log scrolled, the status banner and screen-reader announcements.

const $ = (id) => document.getElementById(id);

export const ui = {
  log: $("log"),
  empty: $("empty"),
  prompt: $("prompt"),
  composer: $("composer"),
  send: $("send"),
  stop: $("stop"),
  newChat: $("new-chat"),
  provenance: $("provenance"),
  panelToggle: $("panel-toggle"),
  sidebar: $("sidebar"),
  conn: $("conn"),
  connText: $("conn-text"),
  banner: $("banner"),
  bannerText: $("banner-text"),
  bannerAction: $("banner-action"),
  settings: $("settings-form"),
  modelName: $("model-name"),
  legend: $("legend"),
  claim: $("claim"),
  announce: $("announce"),
  statsNote: $("stats-note"),
  keyDialog: $("key-dialog"),
  keyForm: $("key-form"),
  keyInput: $("key-input"),
  keyError: $("key-error"),
  history: $("history"),
  historyToggle: $("history-toggle"),
  historyEmpty: $("history-empty"),
  conversations: $("conversation-list"),
  exportChats: $("export-chats"),
  importChats: $("import-chats"),
  system: $("system-prompt"),
  specProposer: $("spec-proposer"),
  specChart: $("spec-position-chart"),
  specStrip: $("spec-step-strip"),
  specSession: $("spec-session-strip"),
  specSummary: $("spec-summary"),
};

export function node(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

export function nearBottom() {
  const log = ui.log;
  return log.scrollHeight - log.scrollTop - log.clientHeight < 80;
}

export function scrollToBottom() {
  ui.log.scrollTop = ui.log.scrollHeight;
}

export function announce(text) {
  // Re-setting the same text would not be announced again; clear first.
  ui.announce.textContent = "";
  requestAnimationFrame(() => {
    ui.announce.textContent = text;
  });
}

export function showBanner(text, action) {
  ui.bannerText.textContent = text;
  ui.banner.hidden = false;
  ui.bannerAction.hidden = !action;
  if (action) {
    ui.bannerAction.textContent = action.label;
    ui.bannerAction.onclick = action.run;
  }
}

export function hideBanner() {
  ui.banner.hidden = true;
}
