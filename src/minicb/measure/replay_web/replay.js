/* minicb replay: plays a recorded run step by step (slots, packed tokens, KV block pool, host pool,
   queues). The data is window.MINICB_REPLAY, written by `python -m minicb.measure.replay` from an
   engine's step events (src/minicb/measure/replay.py documents every field). Plain JavaScript: no
   library, no build step, no network; works from file:// too.

   Every element <div data-minicb-replay> on the page becomes a player. The URL hash #step=N opens
   step N, and stepping keeps the hash current, so a step can be linked to. window.MinicbReplay.render
   draws one frame into any element (a live page can reuse it with frames of its own). */
(function () {
  "use strict";

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      if (k === "text") node.textContent = attrs[k];
      else if (k === "style") node.style.cssText = attrs[k];
      else node.setAttribute(k, attrs[k]);
    });
    (children || []).forEach(function (c) { if (c) node.appendChild(c); });
    return node;
  }

  function chip(data, rid, text, extra) {
    var c = el("span", Object.assign({ "class": "mr-chip", "data-request": rid, text: text || rid,
      style: "background:" + (data.colours[rid] || "#777") }, extra || {}));
    return c;
  }

  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }

  // One sentence on what the step did: rows by kind, preemptions, swaps, finished requests.
  function describe(frame, cfg) {
    var parts = [], kinds = { decode: [], chunk: [], prefill: [] };
    frame.seqs.forEach(function (s) { kinds[s.kind].push(s); });
    if (kinds.decode.length) parts.push(plural(kinds.decode.length, "decode"));
    kinds.chunk.concat(kinds.prefill).forEach(function (s) {
      parts.push((s.kind === "chunk" ? "a prompt chunk of " : "the last prompt tokens of ") + s.id +
        " (positions " + s.start + "–" + (s.start + s.n - 1) + ")");
    });
    var tokens = frame.cu_seqlens_q[frame.cu_seqlens_q.length - 1];
    var text = frame.seqs.length ? "Computes " + parts.join(", ") + ": " + plural(tokens, "token") +
      " of the " + cfg.max_num_batched_tokens + "-token budget." : "Computes nothing (no request is runnable).";
    if (frame.preempted.length) text += " Preempts " + frame.preempted.join(", ") +
      (frame.swap_out.length ? " (swaps " + plural(frame.swap_out.length, "block") + " out to the host)" : "") + ".";
    if (frame.swap_in.length) text += " Swaps " + plural(frame.swap_in.length, "block") + " back in.";
    if (frame.finished.length) text += " Finished afterwards: " + frame.finished.join(", ") + " (slot and blocks free for the next step).";
    if (frame.error) text += " The step failed: " + frame.error;
    return text;
  }

  function section(title, body) {
    return el("div", { "class": "mr-section" }, [el("div", { "class": "mr-title", text: title }), body]);
  }

  function slotTable(data, frame) {
    var rows = frame.state.slots.map(function (rid, i) {
      var s = frame.seqs.filter(function (q) { return q.slot === i; })[0];
      var what = !rid ? "free" : !s ? "holds its slot, computes nothing" :
        s.kind === "decode" ? "decode at position " + s.start :
        (s.kind === "chunk" ? "prompt chunk " : "prompt ") + s.start + "–" + (s.start + s.n - 1);
      var cell = el("td", { "class": "mr-slot", "data-slot": String(i), "data-request": rid || "" },
        [rid ? chip(data, rid) : el("span", { "class": "mr-free", text: "—" })]);
      return el("tr", {}, [el("th", { text: "slot " + i }), cell, el("td", { "class": "mr-what", text: what })]);
    });
    return el("table", { "class": "mr-slots" }, [el("tbody", {}, rows)]);
  }

  function packedTokens(data, frame) {
    var strip = el("div", { "class": "mr-tokens" }, []);
    frame.seqs.forEach(function (s) {
      var group = el("div", { "class": "mr-row", title: s.id + ": " + s.kind + ", block table [" + s.table.join(", ") + "]" }, []);
      for (var k = 0; k < s.n; k++) {
        group.appendChild(el("div", { "class": "mr-token", "data-token": s.id + ":" + (s.start + k) }, [
          chip(data, s.id, s.id + "·" + (s.start + k)),
          el("div", { "class": "mr-kvslot", text: String(s.kv_slots[k]) })]));
      }
      strip.appendChild(group);
    });
    frame.padding.forEach(function (n) {
      strip.appendChild(el("div", { "class": "mr-row mr-padding", text: "padding × " + n }));
    });
    var legend = el("div", { "class": "mr-note" }, [
      el("code", { text: "cu_seqlens_q = [" + frame.cu_seqlens_q.join(", ") + "]" }),
      document.createTextNode("  ·  the number under each token is its "),
      el("code", { text: "slot_mapping" }),
      document.createTextNode(" entry: the KV slot its K/V is written to")]);
    if (!frame.seqs.length) strip.appendChild(el("span", { "class": "mr-free", text: "no tokens this step" }));
    return el("div", {}, [strip, legend]);
  }

  function pool(data, frame, host) {
    var cfg = data.config, st = frame.state;
    var n = host ? cfg.num_host_blocks : cfg.num_blocks;
    var tables = host ? st.host_tables : st.block_tables, owner = {};
    Object.keys(tables).forEach(function (rid) {
      tables[rid].forEach(function (b) { (owner[b] = owner[b] || []).push(rid); });
    });
    var written = {};
    if (!host) frame.seqs.forEach(function (s) {
      s.kv_slots.forEach(function (slot) { written[Math.floor(slot / cfg.block_size)] = true; });
    });
    var moved = {};
    (host ? frame.swap_out.map(function (m) { return m[1]; }) : frame.swap_in.map(function (m) { return m[1]; }))
      .forEach(function (b) { moved[b] = true; });
    var cells = [];
    for (var b = 0; b < n; b++) {
      var who = owner[b] || [];
      var attrs = { "class": "mr-block" + (written[b] ? " mr-written" : "") + (moved[b] ? " mr-moved" : ""),
        text: String(b), title: "block " + b + ": " + (who.length ? "held by " + who.join(", ") : "free") };
      attrs[host ? "data-host-block" : "data-block"] = String(b);
      attrs["data-owner"] = who.join(" ");
      if (who.length) attrs.style = "background:" + (data.colours[who[0]] || "#777") + ";color:#fff";
      cells.push(el("span", attrs));
    }
    return el("div", { "class": "mr-pool" }, cells);
  }

  function queues(data, frame) {
    var st = frame.state;
    function line(name, ids, note) {
      return el("div", { "class": "mr-queue", "data-queue": name }, [el("span", { "class": "mr-qname", text: name })]
        .concat(ids.length ? ids.map(function (r) { return chip(data, r); }) : [el("span", { "class": "mr-free", text: "empty" })])
        .concat([el("span", { "class": "mr-note", text: note })]));
    }
    return el("div", {}, [
      line("waiting", st.waiting, "front first; admitted while a slot, the budget and blocks allow"),
      line("running", st.running, ""),
      line("swapped", st.swapped, "K/V parked in the host pool; swapped in before anyone waiting is admitted")]);
  }

  // Draw frame i of data into root (replacing what was there).
  function render(root, data, i) {
    var frame = data.frames[i], cfg = data.config;
    root.textContent = "";
    root.setAttribute("data-step", String(frame.step));
    root.appendChild(el("p", { "class": "mr-describe", text: describe(frame, cfg) }));
    var grid = el("div", { "class": "mr-grid" }, [
      section("Batch slots (the slot table, as planned)", slotTable(data, frame)),
      section("Queues", queues(data, frame))]);
    root.appendChild(grid);
    root.appendChild(section("The step's packed tokens (request·position), end to end", packedTokens(data, frame)));
    root.appendChild(section("KV block pool: " + cfg.num_blocks + " blocks of " + cfg.block_size +
      " tokens (outlined: written this step; " + frame.state.free_blocks.length + " free)", pool(data, frame, false)));
    if (cfg.num_host_blocks) root.appendChild(section("Host pool (swap): " + cfg.num_host_blocks + " blocks (" +
      frame.state.num_free_host_blocks + " free)", pool(data, frame, true)));
  }

  // #step=N (kept current while stepping) or ?step=N (the page's own links to a step).
  function stepFromHash(n) {
    var m = /step=(\d+)/.exec(window.location.hash) || /[?&]step=(\d+)/.exec(window.location.search);
    return m ? Math.min(parseInt(m[1], 10), n - 1) : 0;
  }

  function mount(root, data) {
    var n = data.frames.length, i = 0, timer = null;
    var view = el("div", { "class": "mr-view" }, []);
    var prev = el("button", { type: "button", "class": "mr-prev", title: "previous step", text: "◀" });
    var play = el("button", { type: "button", "class": "mr-play", title: "play / pause", text: "▶ play" });
    var next = el("button", { type: "button", "class": "mr-next", title: "next step", text: "▶" });
    var slider = el("input", { type: "range", min: "0", max: String(n - 1), value: "0", "class": "mr-slider",
      "aria-label": "step" });
    var label = el("span", { "class": "mr-label" });
    root.textContent = "";
    root.appendChild(el("div", { "class": "mr-controls" }, [prev, play, next, slider, label]));
    root.appendChild(view);

    function show(k, fromHash) {
      i = Math.max(0, Math.min(n - 1, k));
      slider.value = String(i);
      label.textContent = "step " + data.frames[i].step + " of " + (n - 1);
      render(view, data, i);
      if (!fromHash && window.history && window.history.replaceState) {
        window.history.replaceState(null, "", "#step=" + data.frames[i].step);
      }
    }
    function stop() { if (timer) { clearInterval(timer); timer = null; play.textContent = "▶ play"; } }
    prev.addEventListener("click", function () { stop(); show(i - 1); });
    next.addEventListener("click", function () { stop(); show(i + 1); });
    slider.addEventListener("input", function () { stop(); show(parseInt(slider.value, 10)); });
    play.addEventListener("click", function () {
      if (timer) { stop(); return; }
      if (i === n - 1) show(0);
      play.textContent = "⏸ pause";
      timer = setInterval(function () { if (i >= n - 1) stop(); else show(i + 1); }, 800);
    });
    root.addEventListener("keydown", function (e) {
      if (e.key === "ArrowLeft") { stop(); show(i - 1); }
      if (e.key === "ArrowRight") { stop(); show(i + 1); }
    });
    window.addEventListener("hashchange", function () { show(stepFromHash(n), true); });
    show(stepFromHash(n), true);
  }

  function start() {
    var data = window.MINICB_REPLAY;
    document.querySelectorAll("[data-minicb-replay]").forEach(function (root) {
      if (!data) { root.textContent = "replay data missing (docs/assets/replay/data.js)"; return; }
      root.setAttribute("tabindex", "0");
      mount(root, data);
    });
  }

  window.MinicbReplay = { render: render, mount: mount, describe: describe };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
