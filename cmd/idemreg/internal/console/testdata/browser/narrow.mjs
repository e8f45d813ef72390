// Reads the console at 400 px wide in Tokyo's time zone, signed in by a
// proxy's header and secret, for TestConsoleNarrowInBrowser (browser_test.go): the
// status page, the records page and a record, each checked for horizontal
// overflow, and the record's state and times as a person reads them.
import { env, run, overflow } from "./lib.mjs";

const seen = { pages: {} };
await run(seen, {
  viewport: { width: 400, height: 800 },
  timezoneId: "Asia/Tokyo",
  extraHTTPHeaders: { [env("PROXY_HEADER")]: env("PROXY_USER"), [env("PROXY_SECRET_HEADER")]: env("PROXY_SECRET") },
}, async (page) => {
  const base = env("CONSOLE_URL");
  const visit = async (name, path) => {
    await page.goto(base + path);
    seen.pages[name] = await overflow(page);
    await page.screenshot({ path: env("SCREENSHOT_DIR") + "/console-400px-" + name + ".png", fullPage: true });
  };
  await visit("home", "/");
  seen.identity = (await page.textContent("#identity")).trim();
  await visit("records", "/records");
  const row = page.locator("#records tbody tr", { has: page.locator("a.key", { hasText: env("KEY") }) });
  seen.rowState = (await row.locator("td.state").textContent()).trim();
  const t = row.locator("td.age time");
  seen.rowTime = (await t.textContent()).trim();
  seen.rowTimeTitle = await t.getAttribute("title");
  seen.rowRel = (await row.locator("td.age .rel").textContent()).trim();
  seen.rowStateVisible = await row.locator("td.state").isVisible();
  await Promise.all([page.waitForURL(/\/record\?/, { waitUntil: "load" }), row.locator("a.key").click()]);
  seen.pages.record = await overflow(page);
  await page.screenshot({ path: env("SCREENSHOT_DIR") + "/console-400px-record.png", fullPage: true });
  seen.state = (await page.textContent("#state")).trim();
  seen.created = (await page.textContent("#created time")).trim();
  seen.createdTitle = await page.getAttribute("#created time", "title");
});
