// Resolves a parked record through the operator console in Debian's
// Chromium, for TestConsoleResolveInBrowser (browser_test.go), which starts
// the server and the console, parks the record, and passes everything in
// the environment. Prints one JSON line of what it saw.
import { chromium } from "playwright-core";

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
};
const base = env("CONSOLE_URL");
const key = env("KEY");

const context = await chromium.launchPersistentContext(env("USER_DATA_DIR"), {
  executablePath: env("CHROMIUM"),
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  viewport: { width: 1280, height: 900 },
  timeout: 30000,
});
const seen = { dialogs: [], consoleErrors: [] };
try {
  const page = context.pages()[0] ?? (await context.newPage());
  page.setDefaultTimeout(15000);
  // The only dialog the console opens is its confirmation; any other one
  // (an alert from a key or a reason that ran as script) is reported.
  page.on("dialog", async (d) => { seen.dialogs.push({ type: d.type(), message: d.message() }); await d.accept(); });
  page.on("console", (m) => { if (m.type() === "error") seen.consoleErrors.push(m.text()); });
  const text = async (sel) => (await page.textContent(sel)).trim();
  const cells = async (row, names) => {
    const out = {};
    for (const n of names) out[n] = (await row.locator("." + n).first().textContent()).trim();
    return out;
  };

  await page.goto(base + "/");
  await page.fill("#token", env("TOKEN"));
  await page.click("button[type=submit]");
  seen.identity = await text("#identity");
  seen.parked = await text("#parked");
  seen.sweepLag = await text("#sweep-lag");

  // The records page, parked by default; the row of the key.
  await page.click("#nav-records");
  const row = page.locator("#records tbody tr", { has: page.locator("a.key", { hasText: key }) });
  seen.rowsMatching = await row.count();
  seen.row = await cells(row, ["consumer", "key", "state", "attempt", "holder", "park-reason"]);
  await page.screenshot({ path: env("RECORDS_SCREENSHOT"), fullPage: true });

  // The record, with its history.
  await row.locator("a.key").click();
  seen.state = await text("#state");
  seen.keyShown = await text("#key");
  seen.parkReason = await text("#park-reason");
  seen.history = [];
  for (const r of await page.locator("#history tbody tr").all()) {
    seen.history.push(await cells(r, ["attempt", "holder", "end"]));
  }

  // The resolve form: the result's fields show only for "complete".
  seen.resultFieldsHiddenAtFirst = await page.locator("#result-fields").isHidden();
  await page.fill("#resolve-reason", env("REASON"));
  await page.check("#action-complete");
  seen.resultFieldsShownForComplete = await page.locator("#result-fields").isVisible();
  await page.check("#outcome-response");
  await page.fill("#result-type-input", env("RESULT_TYPE"));
  await page.fill("#result-data", env("RESULT_DATA"));
  await page.check("#encoding-text");
  await page.click("#resolve");

  // The confirmation says what will happen, then the record as resolved.
  seen.confirmReason = await text("#confirm-reason");
  seen.confirmAction = await text("#confirm-action");
  seen.confirmType = await text("#confirm-result-type");
  seen.confirmPreview = await text("#confirm-result-preview");
  await page.screenshot({ path: env("CONFIRM_SCREENSHOT"), fullPage: true });
  await page.click("#confirm");
  seen.notice = await text("#notice");
  seen.stateAfter = await text("#state");
  seen.resultType = await text("#result-type");
  seen.resultPreview = await text("#result-preview");
  seen.historyAfter = [];
  for (const r of await page.locator("#history tbody tr").all()) {
    seen.historyAfter.push(await cells(r, ["attempt", "end", "note"]));
  }
  seen.resolveFormAfter = await page.locator("#resolve-form").count();
  seen.releaseAfter = await page.locator("#action-release").count();
  await page.screenshot({ path: env("RESOLVED_SCREENSHOT"), fullPage: true });
} catch (err) {
  const page = context.pages()[0];
  if (page) console.error("page at failure: " + page.url() + "\n" + (await page.content()));
  throw err;
} finally {
  await context.close();
}
console.log(JSON.stringify(seen));
