// A browser-side confirmation before a button marked data-confirm submits;
// the server asks for its own confirmation step (confirm=yes) either way.
document.addEventListener("submit", function (ev) {
  var b = ev.submitter;
  if (b && b.dataset.confirm && !window.confirm(b.dataset.confirm)) {
    ev.preventDefault();
  }
});
