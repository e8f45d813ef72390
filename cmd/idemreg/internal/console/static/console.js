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
