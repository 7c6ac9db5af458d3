// Glue for @jupyter-widgets/html-manager 1.0.6 on the offline book site (loaded after require.js and
// before the html-manager, only on pages that embed widgets).
(function () {
  // 1. The html-manager loads its FontAwesome fonts relative to where require.js places the module
  //    "@jupyter-widgets/html-manager/dist/libembed-amd" (by default next to the page: a 404). Place it in
  //    _static/html-manager/, where the book ships the fonts.
  var here = document.currentScript.src;
  var staticDir = here.slice(0, here.lastIndexOf("/") + 1);
  window.require.config({ paths: { "@jupyter-widgets/html-manager/dist": staticDir + "html-manager" } });

  // 2. It typesets widget labels through MathJax 2 (MathJax.Hub.Queue); the book ships MathJax 3.
  //    MathJax 3 is loaded with `defer`, so install the bridge once the document is parsed.
  document.addEventListener("DOMContentLoaded", function () {
    var mathjax = window.MathJax;
    if (!mathjax || mathjax.Hub) return;
    mathjax.Hub = {
      Queue: function (command) {
        var element = Array.isArray(command) ? command[2] : undefined;
        var ready = mathjax.startup && mathjax.startup.promise ? mathjax.startup.promise : Promise.resolve();
        ready.then(function () {
          if (mathjax.typesetPromise) return mathjax.typesetPromise(element ? [element] : undefined);
        });
      },
    };
  });
})();
