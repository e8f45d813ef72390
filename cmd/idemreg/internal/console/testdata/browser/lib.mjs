// What the console's browser scripts share: the environment the Go test
// passes, and Debian's Chromium launched headless with no network of its
// own (--disable-background-networking) and no browser download.
import { chromium } from "playwright-core";

export const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
};

// launch opens a persistent context with options (viewport, timezoneId,
// extraHTTPHeaders...) and a page that records dialogs (accepted) and
// console errors into seen.
export async function launch(seen, options = {}) {
  const context = await chromium.launchPersistentContext(env("USER_DATA_DIR"), {
    executablePath: env("CHROMIUM"),
    headless: true,
    args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync"],
    viewport: { width: 1100, height: 900 },
    timeout: 30000,
    ...options,
  });
  seen.dialogs = [];
  seen.consoleErrors = [];
  const page = context.pages()[0] ?? (await context.newPage());
  page.setDefaultTimeout(15000);
  page.on("dialog", async (d) => { seen.dialogs.push({ type: d.type(), message: d.message() }); await d.accept(); });
  page.on("console", (m) => { if (m.type() === "error") seen.consoleErrors.push(m.text()); });
  return { context, page };
}

// run runs body, prints seen as one JSON line, and on failure prints the
// page it failed on.
export async function run(seen, options, body) {
  const { context, page } = await launch(seen, options);
  try {
    await body(page);
  } catch (err) {
    console.error("page at failure: " + page.url() + "\n" + (await page.content().catch(() => "")));
    throw err;
  } finally {
    await context.close();
  }
  console.log(JSON.stringify(seen));
}

// overflow is how much wider than the viewport the page is: the document's
// scrollWidth, and the body's.
export const overflow = (page) => page.evaluate(() => ({
  scrollWidth: document.documentElement.scrollWidth,
  bodyScrollWidth: document.body.scrollWidth,
  innerWidth: window.innerWidth,
  // The first elements that reach past the viewport, for the failure's
  // message.
  wide: Array.from(document.querySelectorAll("body *"))
    .filter((el) => el.getBoundingClientRect().right > window.innerWidth + 0.5 && el.offsetParent !== null)
    .slice(0, 5)
    .map((el) => el.tagName.toLowerCase() + (el.id ? "#" + el.id : "") + (el.className ? "." + el.className : "") + " " + Math.round(el.getBoundingClientRect().right)),
}));
