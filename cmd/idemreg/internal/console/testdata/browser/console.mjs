// Drives the operator console in Debian's Chromium, for TestConsoleInBrowser
// (browser_test.go), which starts the server and the console and passes
// everything in the environment. Prints one JSON line of what it saw.
import { chromium } from "playwright-core";

const env = (name) => {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set`);
  return v;
};
const base = env("CONSOLE_URL");

const context = await chromium.launchPersistentContext(env("USER_DATA_DIR"), {
  executablePath: env("CHROMIUM"),
  headless: true,
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  viewport: { width: 1100, height: 900 },
  timeout: 30000,
});
const seen = { dialogs: [], consoleErrors: [] };
try {
  const page = context.pages()[0] ?? (await context.newPage());
  page.setDefaultTimeout(15000);
  // The only dialog the console opens is its confirmation; any other one
  // (an alert from a key that ran as script) is reported to the Go test.
  page.on("dialog", async (d) => { seen.dialogs.push({ type: d.type(), message: d.message() }); await d.accept(); });
  page.on("console", (m) => { if (m.type() === "error") seen.consoleErrors.push(m.text()); });

  await page.goto(base + "/");
  await page.fill("#token", env("TOKEN"));
  await page.click("button[type=submit]");
  seen.identity = await page.textContent("#identity");
  seen.storeHealth = await page.textContent("#store-health");

  await page.fill("input[name=consumer]", env("CONSUMER"));
  await page.selectOption("select[name=kind]", "KIND_OPERATION");
  await page.fill("input[name=key]", env("KEY"));
  await page.click("form.lookup button[type=submit]");
  seen.keyShown = await page.textContent("#key");
  seen.holderShown = await page.textContent("#holder");
  seen.stateBefore = await page.textContent("#state");
  seen.tokenBefore = await page.textContent("#token");

  await page.fill("#reason", env("REASON"));
  await page.click("#invalidate");
  seen.confirmReason = await page.textContent("#confirm-reason");
  await page.click("#confirm");
  seen.notice = await page.textContent("#notice");
  seen.stateAfter = await page.textContent("#state");
  seen.tokenAfter = await page.textContent("#token");
  await page.screenshot({ path: env("SCREENSHOT"), fullPage: true });
} catch (err) {
  const page = context.pages()[0];
  if (page) console.error("page at failure: " + page.url() + "\n" + (await page.content()));
  throw err;
} finally {
  await context.close();
}
console.log(JSON.stringify(seen));
