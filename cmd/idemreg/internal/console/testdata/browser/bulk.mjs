// Invalidates several parked records at once through the console, for
// TestConsoleBulkInBrowser (browser_test.go): select every record of the
// records page, leave one out, give a reason, review, confirm once.
import { env, run } from "./lib.mjs";

const seen = {};
await run(seen, {}, async (page) => {
  const text = async (sel) => (await page.textContent(sel)).trim();
  await page.goto(env("CONSOLE_URL") + "/");
  await page.fill("#token", env("TOKEN"));
  await page.click("button[type=submit]");
  await page.click("#nav-records");
  seen.selectAllVisible = await page.locator("#select-all").isVisible();
  await page.check("#select-all");
  seen.checkedAfterSelectAll = await page.locator("input[name=select]:checked").count();
  const spared = page.locator("#records tbody tr", { has: page.locator("a.key", { hasText: env("SPARED_KEY") }) });
  await spared.locator("input[name=select]").uncheck();
  seen.checked = await page.locator("input[name=select]:checked").count();
  await page.check("#bulk-invalidate");
  await page.fill("#bulk-reason", env("REASON"));
  await page.click("#bulk");

  seen.confirmTitle = await text("h1");
  seen.confirmReason = await text("#bulk-confirm-reason");
  seen.confirmKeys = [];
  for (const li of await page.locator("#bulk-targets li .key").all()) seen.confirmKeys.push((await li.textContent()).trim());
  await page.screenshot({ path: env("CONFIRM_SCREENSHOT"), fullPage: true });
  await page.click("#bulk-confirm");

  seen.notice = await text("#notice");
  seen.results = [];
  for (const r of await page.locator("#bulk-results tbody tr").all()) {
    seen.results.push({ key: (await r.locator(".key").textContent()).trim(), outcome: (await r.locator(".outcome").textContent()).trim() });
  }
  await page.screenshot({ path: env("DONE_SCREENSHOT"), fullPage: true });
  await page.click("#back");
  seen.statesAfter = {};
  for (const r of await page.locator("#records tbody tr").all()) {
    seen.statesAfter[(await r.locator("a.key").textContent()).trim()] = (await r.locator("td.state").textContent()).trim();
  }
});
