/* minicb replay: plays a recorded run step by step (a slot x step strip, slots, packed tokens, the KV
   block pool with ref counts and the prefix cache, the host pool, the queues with the reason each
   waiting request waits). The data is window.MINICB_REPLAY, written by `python -m minicb.measure.replay`
   or `minicb trace --replay` from an engine's events (src/minicb/measure/replay.py documents every
   field). Plain JavaScript: no library, no build step, no network; works from file:// too.

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

  // Black or white text, whichever the recording chose for the request's colour (4.5:1 or better).
  function ink(data, rid) { return (data.text_colours || {})[rid] || "#000"; }
  function paint(data, rid) {
    return "background:" + (data.colours[rid] || "#777") + ";color:" + ink(data, rid);
  }

  function chip(data, rid, text, extra) {
    return el("span", Object.assign({ "class": "mr-chip", "data-request": rid, text: text || rid,
      style: paint(data, rid) }, extra || {}));
  }

  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }

  function range(a, b) { return a === b ? String(a) : a + "–" + b; }
  function span(s) { return (s.n === 1 ? "position " : "positions ") + range(s.start, s.start + s.n - 1); }

  // What a row is: minicb.core.plan.row_kind, as recorded (src/minicb/measure/replay.py): chunk = a
  // prefill short of the prompt's end, recompute = K/V computed again after a recompute preemption,
  // worded with the two parts of the sequence it covers ("recompute, positions 16–22: prompt 0–18,
  // generated 19–22").
  function rowText(s) {
    if (s.kind === "decode") return "decode at position " + s.start;
    if (s.kind === "recompute") {
      var last = s.start + s.n - 1, text = "recompute, " + span(s);
      if (!s.prompt) return text;
      text += ": prompt " + range(0, s.prompt - 1);
      return last >= s.prompt ? text + ", generated " + range(s.prompt, last) : text;
    }
    var of = s.prompt ? " of " + s.prompt : "";
    return (s.kind === "chunk" ? "prompt chunk, " : "prompt end, ") + span(s) + of;
  }

  // One sentence on what the step did: rows by kind, preemptions, swaps, finished requests.
  function describe(frame, cfg) {
    var parts = [], kinds = { decode: [], chunk: [], prefill: [], recompute: [] };
    frame.seqs.forEach(function (s) { kinds[s.kind].push(s); });
    if (kinds.decode.length) parts.push(plural(kinds.decode.length, "decode"));
    kinds.chunk.concat(kinds.prefill).forEach(function (s) {
      parts.push((s.kind === "chunk" ? "a prompt chunk of " : "the last prompt tokens of ") + s.id +
        " (" + span(s) + ")");
    });
    kinds.recompute.forEach(function (s) {
      parts.push("a recompute of " + s.id + " (" + rowText(s).replace(/^recompute, /, "") + ")");
    });
    var tokens = frame.cu_seqlens_q[frame.cu_seqlens_q.length - 1];
    var text = frame.seqs.length ? "Computes " + parts.join(", ") + ": " + plural(tokens, "token") +
      " of the " + cfg.max_num_batched_tokens + "-token budget." : "Computes nothing (no request is runnable).";
    Object.keys(frame.victims || {}).forEach(function (rid) {
      var v = frame.victims[rid];
      text += " Preempts " + rid + " (" + v.mode + "; it held " + plural(v.blocks.length, "block") + ", dashed red" +
        (v.mode === "swap" ? ", copied to the host" : ", freed: it will be computed again") + ").";
    });
    if (frame.swap_in.length) text += " Swaps " + plural(frame.swap_in.length, "block") + " back in.";
    if (frame.finished.length) text += " Finished afterwards: " + frame.finished.join(", ") + " (slot and blocks free for the next step).";
    if (frame.error) text += " The step failed: " + frame.error;
    return text;
  }

  function section(title, body, cls) {
    return el("div", { "class": "mr-section" + (cls ? " " + cls : "") },
      [el("div", { "class": "mr-title", text: title }), body]);
  }

  // The slot x step strip: every step of the run, one row per slot; the current step is marked.
  function strip(data, i, onPick) {
    var cfg = data.config, frames = data.frames;
    var rows = [];
    for (var slot = 0; slot < cfg.num_slots; slot++) {
      var cells = [el("span", { "class": "mr-strip-label", text: "slot " + slot })];
      frames.forEach(function (f, k) {
        var rid = f.state.slots[slot], s = f.seqs.filter(function (q) { return q.slot === slot; })[0];
        var kind = !rid ? "free" : s ? s.kind : "held";
        var attrs = { "class": "mr-cell mr-" + kind + (k === i ? " mr-now" : ""), "data-strip-slot": String(slot),
          "data-strip-step": String(f.step), "data-kind": kind, "data-request": rid || "",
          title: "step " + f.step + ", slot " + slot + ": " + (!rid ? "free" : rid + " " + (s ? rowText(s) : "holds its slot, computes nothing")) };
        if (rid) attrs.style = "background-color:" + (data.colours[rid] || "#777");
        var c = el("span", attrs);
        c.addEventListener("click", function () { onPick(k); });
        cells.push(c);
      });
      rows.push(el("div", { "class": "mr-strip-row" }, cells));
    }
    var legend = el("div", { "class": "mr-note" }, [document.createTextNode(
      "one column per step (click one to go there), the current one framed; striped: prefill (a recompute " +
      "too), solid: decode, " +
      "pale: holds its slot but computes nothing, empty: free")]);
    return el("div", {}, [el("div", { "class": "mr-strip" }, rows), legend]);
  }

  function slotTable(data, frame) {
    var rows = frame.state.slots.map(function (rid, i) {
      var s = frame.seqs.filter(function (q) { return q.slot === i; })[0];
      var what = !rid ? "free" : !s ? "holds its slot, computes nothing" : rowText(s);
      var cell = el("td", { "class": "mr-slot", "data-slot": String(i), "data-request": rid || "" },
        [rid ? chip(data, rid) : el("span", { "class": "mr-free", text: "—" })]);
      return el("tr", {}, [el("th", { text: "slot " + i }), cell,
        el("td", { "class": "mr-what", "data-row-kind": s ? s.kind : "", text: what })]);
    });
    return el("table", { "class": "mr-slots" }, [el("tbody", {}, rows)]);
  }

  function packedTokens(data, frame) {
    var strip = el("div", { "class": "mr-tokens" }, []);
    frame.seqs.forEach(function (s) {
      var group = el("div", { "class": "mr-row", title: s.id + ": " + rowText(s) + ", block table [" + s.table.join(", ") + "]" }, []);
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
    var written = {}, cached = {}, former = {};
    if (!host) {
      frame.seqs.forEach(function (s) {
        s.kv_slots.forEach(function (slot) { written[Math.floor(slot / cfg.block_size)] = true; });
      });
      (st.cached || []).forEach(function (b) { cached[b] = true; });
      Object.keys(frame.victims || {}).forEach(function (rid) {
        frame.victims[rid].blocks.forEach(function (b) { former[b] = rid; });
      });
    }
    var moved = {};
    (host ? frame.swap_out.map(function (m) { return m[1]; }) : frame.swap_in.map(function (m) { return m[1]; }))
      .forEach(function (b) { moved[b] = true; });
    var cells = [];
    for (var b = 0; b < n; b++) {
      var who = owner[b] || [], refs = who.length;
      var cls = "mr-block" + (written[b] ? " mr-written" : "") + (moved[b] ? " mr-moved" : "") +
        (cached[b] ? " mr-cached" : "") + (former[b] !== undefined ? " mr-former" : "") + (refs > 1 ? " mr-shared" : "");
      var title = "block " + b + ": " + (refs ? "held by " + who.join(", ") + " (ref count " + refs + ")" : "free") +
        (cached[b] ? "; in the prefix cache" : "") + (former[b] !== undefined ? "; held by " + former[b] + " before it was preempted" : "");
      var attrs = { "class": cls, title: title, "data-owner": who.join(" "), "data-refs": String(refs) };
      attrs[host ? "data-host-block" : "data-block"] = String(b);
      if (cached[b]) attrs["data-cached"] = "1";
      if (former[b] !== undefined) attrs["data-former"] = former[b];
      if (refs) attrs.style = paint(data, who[0]);
      var kids = [el("span", { "class": "mr-bnum", text: String(b) })];
      if (refs > 1) kids.push(el("span", { "class": "mr-ref", text: "×" + refs }));
      if (cached[b]) kids.push(el("span", { "class": "mr-cmark", text: "c" }));
      cells.push(el("span", attrs, kids));
    }
    var note = el("div", { "class": "mr-note" }, [document.createTextNode(host ?
      "solid red ring: copied out to the host by a swap this step" :
      "framed inside: written this step; ×2: shared by two tables (the ref count); c: in the prefix cache " +
      "(a free block marked c can still be reused by a hit); dashed red border: a block of a request " +
      "preempted this step; solid red ring: copied in from the host by a swap this step")]);
    return el("div", {}, [el("div", { "class": "mr-pool" }, cells), note]);
  }

  function queues(data, frame) {
    var st = frame.state, reasons = frame.waiting || {};
    function line(name, ids, note) {
      var items = ids.map(function (r) {
        if (name !== "waiting") return chip(data, r);
        var why = reasons[r] || ["", ""];
        return el("span", { "class": "mr-wait", "data-waiting": r, "data-reason": why[0] },
          [chip(data, r), el("span", { "class": "mr-reason", title: why[1], text: why[0] }),
           el("span", { "class": "mr-why", text: why[1] })]);
      });
      return el("div", { "class": "mr-queue", "data-queue": name }, [el("span", { "class": "mr-qname", text: name })]
        .concat(items.length ? items : [el("span", { "class": "mr-free", text: "empty" })])
        .concat(note ? [el("div", { "class": "mr-note", text: note })] : []));
    }
    return el("div", {}, [
      line("waiting", st.waiting, "front first; each with the reason it did not get in this step"),
      line("running", st.running, ""),
      line("swapped", st.swapped, "K/V parked in the host pool; swapped in before anyone waiting is admitted")]);
  }

  // Each request's prompt and the text it has generated by this step (recordings of your own prompts:
  // minicb trace --prompts FILE --replay out.html).
  function texts(data, i) {
    var known = {}, order = [];
    for (var k = 0; k <= i; k++) {
      var f = data.frames[k];
      (f.state.waiting.concat(f.state.running, f.state.swapped)).forEach(function (r) {
        if (!(r in known)) { known[r] = ""; order.push(r); }
      });
      Object.keys(f.text || {}).forEach(function (r) { if (!(r in known)) order.push(r); known[r] = f.text[r]; });
    }
    var rows = order.filter(function (r) { return r in data.prompts; }).map(function (r) {
      return el("div", { "class": "mr-text", "data-text": r }, [chip(data, r),
        el("span", { "class": "mr-prompt", text: data.prompts[r] }),
        el("span", { "class": "mr-generated", text: known[r] })]);
    });
    return el("div", {}, rows.length ? rows : [el("span", { "class": "mr-free", text: "no request yet" })]);
  }

  // Draw frame i of data into root (replacing what was there); onPick(k) jumps to frame k.
  function render(root, data, i, onPick) {
    var frame = data.frames[i], cfg = data.config;
    root.textContent = "";
    root.setAttribute("data-step", String(frame.step));
    root.appendChild(section("Slots over the run (slot x step)", strip(data, i, onPick || function () {}), "mr-strip-section"));
    root.appendChild(el("p", { "class": "mr-describe", text: describe(frame, cfg) }));
    var grid = el("div", { "class": "mr-grid" }, [
      section("Batch slots (the slot table, as planned)", slotTable(data, frame)),
      section("Queues", queues(data, frame))]);
    root.appendChild(grid);
    if (data.prompts) root.appendChild(section("Prompts (plain) and the text so far (bold)", texts(data, i)));
    root.appendChild(section("The step's packed tokens (request·position), end to end", packedTokens(data, frame)));
    var shared = Object.keys(frame.state.refs || {}).length;
    root.appendChild(section("KV block pool: " + cfg.num_blocks + " blocks of " + cfg.block_size + " tokens (" +
      frame.state.free_blocks.length + " free" + (shared ? ", " + plural(shared, "shared block") : "") +
      (cfg.prefix_caching ? ", " + (frame.state.cached || []).length + " in the prefix cache" : "") + ")",
      pool(data, frame, false)));
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
      render(view, data, i, function (j) { stop(); show(j); });
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

  window.MinicbReplay = { render: render, mount: mount, describe: describe, rowText: rowText };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
