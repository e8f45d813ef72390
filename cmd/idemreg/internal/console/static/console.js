// A browser-side confirmation before a button marked data-confirm submits;
// the server asks for its own confirmation step (confirm=yes) either way.
document.addEventListener("submit", function (ev) {
  var b = ev.submitter;
  if (b && b.dataset.confirm && !window.confirm(b.dataset.confirm)) {
    ev.preventDefault();
  }
});

// A fieldset marked data-shown-by="ID" is shown only while the radio
// button ID is checked (the resolve form's result, for "complete"). Without
// script every field shows, and the server ignores those the choice does
// not use.
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("[data-shown-by]").forEach(function (el) {
    var radio = document.getElementById(el.dataset.shownBy);
    if (!radio || !radio.form) return;
    var update = function () { el.hidden = !radio.checked; };
    radio.form.addEventListener("change", update);
    update();
  });
});

// Times are written by the server in UTC, to the second; here they are
// written again in the browser's own time zone, the exact UTC instant
// staying in the element's title.
document.addEventListener("DOMContentLoaded", function () {
  var pad = function (n) { return String(n).padStart(2, "0"); };
  document.querySelectorAll("time[datetime]").forEach(function (el) {
    var d = new Date(el.getAttribute("datetime"));
    if (isNaN(d.getTime())) return;
    var zone = "";
    try {
      var part = new Intl.DateTimeFormat(undefined, { timeZoneName: "short" }).formatToParts(d)
        .find(function (p) { return p.type === "timeZoneName"; });
      if (part) zone = " " + part.value;
    } catch (e) { /* no zone name: the time alone */ }
    el.textContent = d.getFullYear() + "-" + pad(d.getMonth() + 1) + "-" + pad(d.getDate()) + " " +
      pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) + zone;
  });
});

// A checkbox marked data-select-all="NAME" (hidden without script) checks
// or clears every checkbox named NAME of its form.
document.addEventListener("DOMContentLoaded", function () {
  document.querySelectorAll("[data-select-all]").forEach(function (all) {
    var boxes = function () { return all.form ? all.form.querySelectorAll('input[type=checkbox][name="' + all.dataset.selectAll + '"]') : []; };
    all.hidden = false;
    all.addEventListener("change", function () { boxes().forEach(function (b) { b.checked = all.checked; }); });
  });
});
