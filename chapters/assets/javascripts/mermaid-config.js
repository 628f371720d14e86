/* The site's mermaid settings, joined to material's: material calls mermaid.initialize once,
   before the first diagram (its theme, its font sizes), and these tighten a sequence
   diagram's spacing so that four or five lanes fit the content column (688 px at a 1280 px
   window); mermaid's useMaxWidth scales a diagram still wider down to the column, and
   tests/site checks that no label ends up smaller than 11 px. Without the vendored mermaid
   (material then loads it from its CDN) the diagrams keep mermaid's own spacing. */
(() => {
  if (typeof mermaid === "undefined") return;
  const SEQUENCE = {
    diagramMarginX: 10, // around the diagram (50)
    actorMargin: 20, // the least gap between two participants' boxes (50)
    width: 100, // the least width of a participant's box (150)
  };
  const init = mermaid.initialize;
  mermaid.initialize = (config) =>
    init.call(mermaid, {...config, sequence: {...config.sequence, ...SEQUENCE}});
})();
