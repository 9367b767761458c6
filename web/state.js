// The conversation on screen and the socket it is held over, shared by the chat's modules.

import { socketProtocols } from "./auth.js";
import { Connection, socketUrl } from "./socket.js";
import { SessionStats } from "./stats.js";
import { SessionTrace } from "./specview.js";

/** @typedef {{user: string, text: string, segments: object[], status: string, id: string|null,
 *   error: string|null, finish: string|null, stats: ReplyStats|null, el: object}} Turn */
export const state = {
  /** @type {Turn[]} */
  turns: [],
  /** @type {Turn|null} the turn whose reply is streaming */
  active: null,
  session: new SessionStats(), // since the page loaded; "New chat" keeps it
  sessionTrace: new SessionTrace(),
  lastReply: null,
  /** @type {SpecTrace|null} the speculation of the reply the stats show */
  lastTrace: null,
  /** @type {{id: string, title: string, created: number}|null} the saved conversation on screen */
  conv: null,
  nextId: 1,
};

export const conn = new Connection(socketUrl(), { protocols: socketProtocols });

export const lastTurn = () => state.turns[state.turns.length - 1] || null;
