// How the server speculates, in words. GET /v1/models describes it (`speculation`, see
// docs/PROTOCOL.md); the legend under the stats names the proposer whose accepted guesses the
// provenance tint marks.

/**
 * The proposer's name, or null when the server does not speculate.
 * @param {{method: string, draft_model: string|null, tree: string|null}} spec
 */
export function proposerName(spec) {
  switch (spec.method) {
    case "none":
      return null;
    case "ngram":
      return "n-gram lookup";
    case "draft":
      return spec.draft_model ? `draft model ${spec.draft_model}` : "a draft model";
    case "eagle":
      return spec.tree ? "EAGLE head (tree)" : "EAGLE head (chain)";
    case "synthetic":
      return "synthetic drafts";
    default:
      return String(spec.method);
  }
}

function sample(draft, text) {
  const e = document.createElement("span");
  e.className = draft ? "tok draft sample" : "tok sample";
  e.textContent = text;
  return e;
}

/** Rewrite the legend element for `spec` (an object from /v1/models). */
export function renderLegend(legend, spec) {
  const name = proposerName(spec);
  if (name === null) {
    legend.replaceChildren("Speculation is off on this server: the target samples every token, so none is tinted.");
    return;
  }
  const proposer = document.createElement("span");
  proposer.className = "proposer";
  proposer.textContent = name;
  legend.replaceChildren(
    sample(true, "draft"),
    " proposed by ",
    proposer,
    ", accepted by the target · ",
    sample(false, "target"),
    " sampled by the target",
  );
}

/** What speculation guarantees on this server, for the empty chat's first line. */
export function renderClaim(claim, spec) {
  claim.textContent = spec.exact
    ? "Every token you see was checked by the target model, and this server runs in exact mode: " +
      "replies are token for token what it says without speculation, whatever else it serves."
    : "Every token you see was checked by the target model: speculation changes how fast replies " +
      "come, not what the model may say.";
}
