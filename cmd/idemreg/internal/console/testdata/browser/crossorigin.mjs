// Submits a form to the console from a page of another origin, for
// TestConsoleCrossOriginInBrowser (browser_test.go): Chromium marks the
// request cross-origin and the console refuses it.
import { env, run } from "./lib.mjs";

const seen = {};
await run(seen, {}, async (page) => {
  await page.goto(env("OTHER_URL") + "/");
  const [res] = await Promise.all([page.waitForNavigation(), page.click("#submit")]);
  seen.status = res.status();
  seen.url = page.url();
  seen.error = (await page.textContent("#error").catch(() => "")).trim();
  seen.signedIn = await page.locator("#identity").count();
  await page.goto(env("CONSOLE_URL") + "/");
  seen.signedInAfter = await page.locator("#identity").count();
});
